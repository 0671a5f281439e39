//! TPC-C's random inputs (TPC-C 5.11, clauses 2.1.6 and 4.3.2): the non-uniform NURand
//! distribution and its run-time constants, customer last names from syllables, and the
//! random strings the population uses. The TPC-C workload builds on these.

use crate::Rand;

/// The `A` of NURand for customer last names (clause 2.1.6).
pub const A_C_LAST: u64 = 255;
/// The `A` of NURand for customer ids.
pub const A_C_ID: u64 = 1023;
/// The `A` of NURand for item ids.
pub const A_OL_I_ID: u64 = 8191;

/// The run-time constants `C` of NURand (clause 2.1.6.1): one per field, drawn once per run;
/// the one for last names at run time differs from the one the population used by 65 to 119,
/// and not by 96 or 112.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NuRandConstants {
    /// For last names while populating.
    pub c_last_load: u64,
    /// For last names while running.
    pub c_last_run: u64,
    /// For customer ids.
    pub c_id: u64,
    /// For item ids.
    pub ol_i_id: u64,
}

impl NuRandConstants {
    /// Draws the constants.
    pub fn draw(rng: &mut Rand) -> Self {
        let c_last_load = rng.range(0, A_C_LAST);
        let c_last_run = loop {
            let c = rng.range(0, A_C_LAST);
            let delta = c.abs_diff(c_last_load);
            if (65..=119).contains(&delta) && delta != 96 && delta != 112 {
                break c;
            }
        };
        Self {
            c_last_load,
            c_last_run,
            c_id: rng.range(0, A_C_ID),
            ol_i_id: rng.range(0, A_OL_I_ID),
        }
    }
}

/// NURand(A, x, y) with constant `c`: `(((random(0, A) | random(x, y)) + C) % (y - x + 1)) + x`.
pub fn nurand(rng: &mut Rand, a: u64, c: u64, x: u64, y: u64) -> u64 {
    (((rng.range(0, a) | rng.range(x, y)) + c) % (y - x + 1)) + x
}

/// The syllables of last names (clause 4.3.2.3).
const SYLLABLES: [&str; 10] = [
    "BAR", "OUGHT", "ABLE", "PRI", "PRES", "ESE", "ANTI", "CALLY", "ATION", "EING",
];

/// The last name of number `n` (0 to 999): its three digits' syllables, concatenated, in a
/// zero-padded 16-byte field.
pub fn last_name(n: u64) -> [u8; 16] {
    assert!(n < 1000, "last-name number {n} is not 0 to 999");
    let mut out = [0u8; 16];
    let mut at = 0;
    for digit in [n / 100, n / 10 % 10, n % 10] {
        let s = SYLLABLES[digit as usize].as_bytes();
        out[at..at + s.len()].copy_from_slice(s);
        at += s.len();
    }
    out
}

/// A random alphanumeric string of `lo` to `hi` characters in an `N`-byte zero-padded field.
pub fn a_string<const N: usize>(rng: &mut Rand, lo: usize, hi: usize) -> [u8; N] {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let len = rng.range(lo as u64, hi.min(N) as u64) as usize;
    let mut out = [0u8; N];
    for b in out.iter_mut().take(len) {
        *b = ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize];
    }
    out
}

/// A random string of `lo` to `hi` digits in an `N`-byte zero-padded field.
pub fn n_string<const N: usize>(rng: &mut Rand, lo: usize, hi: usize) -> [u8; N] {
    let len = rng.range(lo as u64, hi.min(N) as u64) as usize;
    let mut out = [0u8; N];
    for b in out.iter_mut().take(len) {
        *b = b'0' + (rng.next_u64() % 10) as u8;
    }
    out
}

/// A zip code: 4 random digits then "11111" (clause 4.3.2.7).
pub fn zip(rng: &mut Rand) -> [u8; 9] {
    let mut out = *b"000011111";
    for b in out.iter_mut().take(4) {
        *b = b'0' + (rng.next_u64() % 10) as u8;
    }
    out
}

/// I_DATA or S_DATA: 26 to 50 random characters, and in 10% of rows "ORIGINAL" at a random
/// position (clause 4.3.3.1).
pub fn data_with_original(rng: &mut Rand) -> [u8; 50] {
    let mut out: [u8; 50] = a_string(rng, 26, 50);
    if rng.range(1, 10) == 1 {
        let len = out.iter().position(|b| *b == 0).unwrap_or(50);
        let at = rng.range(0, (len - 8) as u64) as usize;
        out[at..at + 8].copy_from_slice(b"ORIGINAL");
    }
    out
}
