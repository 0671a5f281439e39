//! TPC-C's random inputs against the specification's rules (clauses 2.1.6 and 4.3.2).

use farm_workloads::tpcc_input::{
    a_string, data_with_original, last_name, n_string, nurand, zip, NuRandConstants, A_C_ID,
    A_C_LAST,
};
use farm_workloads::Rand;

#[test]
fn nurand_stays_in_range_and_is_skewed() {
    let mut rng = Rand::new(5);
    let c = NuRandConstants::draw(&mut rng);
    let mut hits = vec![0u32; 3001];
    for _ in 0..300_000 {
        let id = nurand(&mut rng, A_C_ID, c.c_id, 1, 3000);
        assert!((1..=3000).contains(&id));
        hits[id as usize] += 1;
    }
    let mean = 300_000 / 3000;
    let max = *hits.iter().max().unwrap();
    assert!(max > 3 * mean, "not skewed: max {max}, mean {mean}");
    // Most ids are drawn (an id reachable only with random(0, A) = 0 may not be).
    let drawn = hits[1..].iter().filter(|h| **h > 0).count();
    assert!(drawn > 2900, "only {drawn} of 3000 ids drawn");
}

#[test]
fn run_time_constant_of_last_names_keeps_its_distance() {
    let mut rng = Rand::new(9);
    for _ in 0..1000 {
        let c = NuRandConstants::draw(&mut rng);
        let d = c.c_last_run.abs_diff(c.c_last_load);
        assert!((65..=119).contains(&d) && d != 96 && d != 112, "{c:?}");
        assert!(c.c_last_load <= A_C_LAST && c.c_last_run <= A_C_LAST);
    }
}

#[test]
fn last_names_are_three_syllables() {
    let name = |n| {
        let b = last_name(n);
        String::from_utf8(b.iter().copied().take_while(|b| *b != 0).collect()).unwrap()
    };
    assert_eq!(name(0), "BARBARBAR");
    assert_eq!(name(371), "PRICALLYOUGHT");
    assert_eq!(name(999), "EINGEINGEING");
    assert_eq!(name(40), "BARPRESBAR");
}

#[test]
fn strings_have_their_lengths_and_alphabets() {
    let mut rng = Rand::new(11);
    let mut originals = 0;
    for _ in 0..10_000 {
        let a: [u8; 24] = a_string(&mut rng, 8, 16);
        let len = a.iter().position(|b| *b == 0).unwrap_or(24);
        assert!((8..=16).contains(&len) && a[..len].iter().all(u8::is_ascii_alphanumeric));
        let n: [u8; 16] = n_string(&mut rng, 16, 16);
        assert!(n.iter().all(u8::is_ascii_digit));
        let z = zip(&mut rng);
        assert!(z[..4].iter().all(u8::is_ascii_digit) && &z[4..] == b"11111");
        let d = data_with_original(&mut rng);
        let len = d.iter().position(|b| *b == 0).unwrap_or(50);
        assert!((26..=50).contains(&len));
        originals += d.windows(8).any(|w| w == b"ORIGINAL") as u32;
    }
    // 10% of rows, give or take (3 standard deviations of 10,000 draws: 90).
    assert!(
        (910..=1090).contains(&originals),
        "{originals} ORIGINAL rows"
    );
}
