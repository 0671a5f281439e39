//! Cross-check of the strict-serializability checker against the `adya` crate (an independent
//! implementation of Elle) on generated list-append histories: a serial execution whose reads
//! are sometimes made stale. Both checkers must agree on valid versus invalid for every history.

use farm_core::rng::Rng;
use farm_sim::{check, Op, TxnRecord};

fn generate(seed: u64) -> Vec<TxnRecord> {
    let mut rng = Rng::new(seed);
    let keys = 1 + rng.below(3);
    let mut lists: Vec<Vec<u64>> = vec![Vec::new(); keys as usize];
    let mut next = 1;
    let n = 4 + rng.below(8);
    (0..n)
        .map(|i| {
            let ops = (0..1 + rng.below(3))
                .map(|_| {
                    let key = rng.below(keys);
                    let list = &mut lists[key as usize];
                    if rng.below(2) == 0 {
                        next += 1;
                        list.push(next);
                        Op::Append { key, value: next }
                    } else {
                        let mut len = list.len();
                        if len > 0 && rng.chance(150_000) {
                            len -= 1 + rng.below(len as u64) as usize; // a stale read
                        }
                        Op::Read {
                            key,
                            values: list[..len].to_vec(),
                        }
                    }
                })
                .collect();
            let invoke = 10 * i;
            TxnRecord {
                ops,
                invoke,
                complete: invoke + 1 + 10 * rng.below(4),
                committed: true,
            }
        })
        .collect()
}

fn to_jsonl(h: &[TxnRecord]) -> String {
    let mut events: Vec<(u64, usize, bool)> = Vec::new();
    for (i, t) in h.iter().enumerate() {
        events.push((t.invoke, i, false));
        events.push((t.complete, i, true));
    }
    events.sort();
    let mut out = String::new();
    for (index, (_, i, done)) in events.into_iter().enumerate() {
        let mops: Vec<String> = h[i]
            .ops
            .iter()
            .map(|op| match op {
                Op::Append { key, value } => format!("[\"append\",{key},{value}]"),
                Op::Read { key, values } if done => format!("[\"r\",{key},{values:?}]"),
                Op::Read { key, .. } => format!("[\"r\",{key},null]"),
            })
            .collect();
        let kind = if done { "ok" } else { "invoke" };
        out.push_str(&format!(
            "{{\"type\":\"{kind}\",\"f\":\"txn\",\"value\":[{}],\"process\":{i},\"index\":{index}}}\n",
            mops.join(",")
        ));
    }
    out
}

#[test]
fn verdicts_agree_with_adya() {
    let (mut valid, mut invalid) = (0, 0);
    for seed in 0..400 {
        let h = generate(seed);
        let ours = check(&h);
        let history = adya::History::parse(&to_jsonl(&h)).expect("adya parses the history");
        let report = adya::check(&history, adya::Workload::ListAppend, &adya::Opts::default());
        if report.valid == adya::Valid::Unknown {
            continue;
        }
        let theirs_ok = report.valid == adya::Valid::True;
        assert_eq!(
            ours.is_empty(),
            theirs_ok,
            "seed {seed}: ours {ours:?}, adya {:?}\n{}",
            report.anomaly_types,
            to_jsonl(&h)
        );
        if theirs_ok {
            valid += 1;
        } else {
            invalid += 1;
        }
    }
    assert!(
        valid > 50 && invalid > 20,
        "generated {valid} valid and {invalid} invalid histories"
    );
}
