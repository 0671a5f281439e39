//! List-append histories and an Elle-style strict-serializability checker.
//!
//! Each transaction appends unique values to lists and reads whole lists. Because every read
//! returns a whole list, the version order of each key is recoverable: it is the longest list
//! read (every other read must be a prefix). From it the checker derives dependency edges
//! between committed transactions (Adya's ww, wr, rw) and real-time edges (T1 completed before
//! T2 was invoked), then searches for cycles and names them:
//! G0 (ww only), G1c (ww and wr), G-single (one rw: lost update, read skew), G2 (several rw:
//! write skew), and a real-time violation (a cycle that needs an rt edge: a stale read). It also
//! flags reads of aborted writes (G1a), of intermediate states (G1b), of values never written, incompatible orders, and reads
//! that miss the transaction's own earlier appends (internal).

use std::collections::{BTreeMap, BTreeSet};

/// One operation inside a transaction.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Op {
    /// Appended `value` to `key`.
    Append {
        /// The list.
        key: u64,
        /// A value unique in the whole history.
        value: u64,
    },
    /// Read `key`, seeing `values`.
    Read {
        /// The list.
        key: u64,
        /// The list as read.
        values: Vec<u64>,
    },
}

/// A transaction of the history.
#[derive(Clone, Debug)]
pub struct TxnRecord {
    /// Operations in program order.
    pub ops: Vec<Op>,
    /// When it was invoked (any monotonic clock).
    pub invoke: u64,
    /// When its outcome was known.
    pub complete: u64,
    /// Whether it committed (acknowledged).
    pub committed: bool,
}

/// A violation found by [`check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Anomaly {
    /// Its name (G0, G1a, G1c, G-single, G2, real-time, incompatible-order, garbage-read, ...).
    pub name: &'static str,
    /// A human description with the transactions involved.
    pub detail: String,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Edge {
    Ww,
    Wr,
    Rw,
    Rt,
}

/// Checks `history` for strict serializability. Returns every anomaly found (empty when fine).
pub fn check(history: &[TxnRecord]) -> Vec<Anomaly> {
    let mut anomalies = Vec::new();
    let mut writer: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, t) in history.iter().enumerate() {
        for op in &t.ops {
            if let Op::Append { value, .. } = op {
                if writer.insert(*value, i).is_some() {
                    anomalies.push(Anomaly {
                        name: "duplicate-append",
                        detail: format!("value {value} appended twice"),
                    });
                }
            }
        }
    }
    // Internal consistency: a read sees the transaction's own earlier reads and appends.
    for (i, t) in history.iter().enumerate().filter(|(_, t)| t.committed) {
        let mut seen: BTreeMap<u64, (Option<Vec<u64>>, Vec<u64>)> = BTreeMap::new();
        for op in &t.ops {
            match op {
                Op::Append { key, value } => seen.entry(*key).or_default().1.push(*value),
                Op::Read { key, values } => {
                    let (prev, own) = seen.entry(*key).or_default();
                    let ok = match prev {
                        Some(p) => {
                            values.len() == p.len() + own.len()
                                && values.starts_with(p)
                                && values.ends_with(own)
                        }
                        None => values.ends_with(own),
                    };
                    if !ok {
                        anomalies.push(Anomaly {
                            name: "internal",
                            detail: format!("T{i} read {values:?} from key {key} after its own {prev:?} and appends {own:?}"),
                        });
                    }
                    *prev = Some(values.clone());
                    own.clear();
                }
            }
        }
    }
    // Version order per key: the longest committed read; every read must be its prefix.
    let mut order: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for t in history.iter().filter(|t| t.committed) {
        for op in &t.ops {
            if let Op::Read { key, values } = op {
                let o = order.entry(*key).or_default();
                if values.len() > o.len() {
                    if !values.starts_with(o) {
                        anomalies.push(Anomaly {
                            name: "incompatible-order",
                            detail: format!("key {key}: {values:?} vs {o:?}"),
                        });
                    }
                    *o = values.clone();
                } else if !o.starts_with(values) {
                    anomalies.push(Anomaly {
                        name: "incompatible-order",
                        detail: format!("key {key}: {values:?} vs {o:?}"),
                    });
                }
            }
        }
    }
    for (key, o) in &order {
        let mut seen = BTreeSet::new();
        for v in o {
            if !seen.insert(*v) {
                anomalies.push(Anomaly {
                    name: "duplicate-element",
                    detail: format!("key {key}: {v} twice in {o:?}"),
                });
            }
            match writer.get(v) {
                None => anomalies.push(Anomaly {
                    name: "garbage-read",
                    detail: format!("key {key}: value {v} was never appended"),
                }),
                Some(w) if !history[*w].committed => anomalies.push(Anomaly {
                    name: "G1a",
                    detail: format!("key {key}: value {v} read, but its transaction T{w} aborted"),
                }),
                Some(_) => {}
            }
        }
    }
    // G1b: a read must not end in the middle of another transaction's appends to the key.
    let mut last_append: BTreeMap<(usize, u64), u64> = BTreeMap::new();
    for (i, t) in history.iter().enumerate() {
        for op in &t.ops {
            if let Op::Append { key, value } = op {
                last_append.insert((i, *key), *value);
            }
        }
    }
    for (i, t) in history.iter().enumerate().filter(|(_, t)| t.committed) {
        for op in &t.ops {
            let Op::Read { key, values } = op else {
                continue;
            };
            let Some(v) = values.last() else { continue };
            let Some(&w) = writer.get(v) else { continue };
            if w != i && last_append.get(&(w, *key)) != Some(v) {
                anomalies.push(Anomaly {
                    name: "G1b",
                    detail: format!(
                        "T{i} read {values:?} from key {key}: an intermediate state of T{w}"
                    ),
                });
            }
        }
    }
    if !anomalies.is_empty() {
        return anomalies;
    }
    let committed: Vec<usize> = (0..history.len())
        .filter(|i| history[*i].committed)
        .collect();
    let n = history.len();
    // Nodes: transactions 0..n, then time points n.. for real-time edges.
    let mut times: Vec<u64> = committed.iter().map(|i| history[*i].complete).collect();
    times.sort_unstable();
    times.dedup();
    let mut adj: Vec<Vec<(usize, Edge)>> = vec![Vec::new(); n + times.len()];
    for w in times.windows(2).enumerate() {
        adj[n + w.0].push((n + w.0 + 1, Edge::Rt));
    }
    for &i in &committed {
        let c = times.binary_search(&history[i].complete).expect("listed");
        adj[i].push((n + c, Edge::Rt));
        // The latest completion strictly before this transaction's invocation.
        let j = times.partition_point(|t| *t < history[i].invoke);
        if j > 0 {
            adj[n + j - 1].push((i, Edge::Rt));
        }
    }
    let mut unobserved: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
    for &i in &committed {
        for op in &history[i].ops {
            if let Op::Append { key, value } = op {
                if !order.get(key).is_some_and(|o| o.contains(value)) {
                    unobserved.entry(*key).or_default().insert(i);
                }
            }
        }
    }
    for (key, o) in &order {
        for pair in o.windows(2) {
            let (a, b) = (writer[&pair[0]], writer[&pair[1]]);
            if a != b {
                adj[a].push((b, Edge::Ww));
            }
        }
        for &i in &committed {
            for op in &history[i].ops {
                let Op::Read { key: k, values } = op else {
                    continue;
                };
                if k != key {
                    continue;
                }
                if let Some(last) = values.last() {
                    let w = writer[last];
                    if w != i {
                        adj[w].push((i, Edge::Wr));
                    }
                }
                if let Some(next) = o.get(values.len()) {
                    let w = writer[next];
                    if w != i {
                        adj[i].push((w, Edge::Rw));
                    }
                }
                // Committed appends no read observed come after every observed value, so
                // every reader of the key precedes their writers.
                for &w in unobserved.get(key).into_iter().flatten() {
                    if w != i {
                        adj[i].push((w, Edge::Rw));
                    }
                }
            }
        }
    }
    for cycle in cycles(&adj, n) {
        let kinds: BTreeSet<Edge> = cycle.iter().map(|(_, e)| *e).collect();
        let rw = cycle.iter().filter(|(_, e)| *e == Edge::Rw).count();
        let name = if kinds.contains(&Edge::Rt) {
            "real-time"
        } else if rw == 0 && !kinds.contains(&Edge::Wr) {
            "G0"
        } else if rw == 0 {
            "G1c"
        } else if rw == 1 {
            "G-single"
        } else {
            "G2"
        };
        let txns: Vec<String> = cycle
            .iter()
            .filter(|(v, _)| *v < n)
            .map(|(v, e)| format!("T{v} -{e:?}->"))
            .collect();
        anomalies.push(Anomaly {
            name,
            detail: format!("cycle {}", txns.join(" ")),
        });
    }
    anomalies
}

/// One cycle per non-trivial strongly connected component, as (node, edge to next) lists,
/// preferring cycles without real-time edges when the component has one.
fn cycles(adj: &[Vec<(usize, Edge)>], txns: usize) -> Vec<Vec<(usize, Edge)>> {
    let sccs = tarjan(adj);
    let mut out = Vec::new();
    for comp in sccs {
        if comp.len() < 2 || comp.iter().all(|v| *v >= txns) {
            continue;
        }
        let members: BTreeSet<usize> = comp.iter().copied().collect();
        let start = *comp.iter().find(|v| **v < txns).expect("has a transaction");
        // Try a cycle using dependency edges only first, then any.
        let found = shortest_cycle(adj, &members, start, false)
            .or_else(|| shortest_cycle(adj, &members, start, true));
        if let Some(c) = found {
            out.push(c);
        }
    }
    out
}

fn shortest_cycle(
    adj: &[Vec<(usize, Edge)>],
    members: &BTreeSet<usize>,
    start: usize,
    allow_rt: bool,
) -> Option<Vec<(usize, Edge)>> {
    let mut prev: BTreeMap<usize, (usize, Edge)> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &(w, e) in &adj[v] {
            if !members.contains(&w) || (!allow_rt && e == Edge::Rt) {
                continue;
            }
            if w == start {
                let mut path = vec![(v, e)];
                let mut cur = v;
                while cur != start {
                    let (p, pe) = prev[&cur];
                    path.push((p, pe));
                    cur = p;
                }
                path.reverse();
                return Some(path);
            }
            if let std::collections::btree_map::Entry::Vacant(slot) = prev.entry(w) {
                slot.insert((v, e));
                queue.push_back(w);
            }
        }
    }
    None
}

/// Tarjan's strongly connected components, iterative (histories can be long).
fn tarjan(adj: &[Vec<(usize, Edge)>]) -> Vec<Vec<usize>> {
    let n = adj.len();
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut stack = Vec::new();
    let mut out = Vec::new();
    let mut next = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut call: Vec<(usize, usize)> = vec![(root, 0)];
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (v, ref mut i)) = call.last_mut() {
            if *i < adj[v].len() {
                let w = adj[v][*i].0;
                *i += 1;
                if index[w] == usize::MAX {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    call.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                call.pop();
                if let Some(&(parent, _)) = call.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] == index[v] {
                    let mut comp = Vec::new();
                    loop {
                        let w = stack.pop().expect("on stack");
                        on_stack[w] = false;
                        comp.push(w);
                        if w == v {
                            break;
                        }
                    }
                    out.push(comp);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ops: Vec<Op>, invoke: u64, complete: u64) -> TxnRecord {
        TxnRecord {
            ops,
            invoke,
            complete,
            committed: true,
        }
    }
    fn app(key: u64, value: u64) -> Op {
        Op::Append { key, value }
    }
    fn rd(key: u64, values: &[u64]) -> Op {
        Op::Read {
            key,
            values: values.to_vec(),
        }
    }
    fn names(h: &[TxnRecord]) -> Vec<&'static str> {
        check(h).into_iter().map(|a| a.name).collect()
    }

    #[test]
    fn serial_history_passes() {
        let h = vec![
            t(vec![rd(1, &[]), app(1, 10)], 0, 1),
            t(vec![rd(1, &[10]), app(1, 11), app(2, 20)], 2, 3),
            t(vec![rd(1, &[10, 11]), rd(2, &[20])], 4, 5),
        ];
        assert!(check(&h).is_empty(), "{:?}", check(&h));
    }

    #[test]
    fn lost_update_is_g_single() {
        // Both read the empty list and append; a later read shows both appends.
        let h = vec![
            t(vec![rd(1, &[]), app(1, 10)], 0, 5),
            t(vec![rd(1, &[]), app(1, 11)], 0, 5),
            t(vec![rd(1, &[10, 11])], 6, 7),
        ];
        assert_eq!(names(&h), vec!["G-single"]);
    }

    #[test]
    fn write_skew_is_g2() {
        let h = vec![
            t(vec![rd(1, &[]), rd(2, &[]), app(1, 10)], 0, 5),
            t(vec![rd(1, &[]), rd(2, &[]), app(2, 20)], 0, 5),
            t(vec![rd(1, &[10]), rd(2, &[20])], 6, 7),
        ];
        assert_eq!(names(&h), vec!["G2"]);
    }

    #[test]
    fn stale_read_violates_real_time() {
        // T1 commits an append before T2 starts, yet T2 reads the old (empty) list.
        let h = vec![
            t(vec![app(1, 10)], 0, 1),
            t(vec![rd(1, &[])], 2, 3),
            t(vec![rd(1, &[10])], 4, 5),
        ];
        assert_eq!(names(&h), vec!["real-time"]);
    }

    #[test]
    fn circular_information_flow_is_g1c() {
        // T1 reads T2's append to key 2 and T2 reads T1's append to key 1.
        let h = vec![
            t(vec![app(1, 10), rd(2, &[20])], 0, 5),
            t(vec![app(2, 20), rd(1, &[10])], 0, 5),
        ];
        assert_eq!(names(&h), vec!["G1c"]);
    }

    #[test]
    fn aborted_reads_and_garbage_are_flagged() {
        let mut aborted = t(vec![app(1, 10)], 0, 1);
        aborted.committed = false;
        let h = vec![aborted, t(vec![rd(1, &[10])], 2, 3)];
        assert_eq!(names(&h), vec!["G1a"]);
        let h = vec![t(vec![rd(1, &[99])], 0, 1)];
        assert_eq!(names(&h), vec!["garbage-read"]);
        let h = vec![
            t(vec![app(1, 1), app(1, 2)], 0, 1),
            t(vec![rd(1, &[1, 2])], 2, 3),
            t(vec![rd(1, &[2])], 2, 3),
        ];
        assert_eq!(names(&h), vec!["incompatible-order"]);
    }

    #[test]
    fn missing_an_unobserved_append_is_g_single() {
        // T3 sees T2's append to key 1 but not its (never observed) append to key 0.
        let h = vec![
            t(vec![app(0, 3)], 0, 1),
            t(vec![app(1, 4), app(0, 6)], 2, 3),
            t(vec![rd(0, &[3]), rd(1, &[4])], 4, 5),
        ];
        assert_eq!(names(&h), vec!["G-single"]);
        let h = vec![
            t(vec![app(0, 3)], 0, 1),
            t(vec![app(1, 4), app(0, 6)], 2, 9),
            t(vec![rd(0, &[3]), rd(1, &[4])], 4, 9),
        ];
        assert_eq!(names(&h), vec!["G-single"]);
    }

    #[test]
    fn intermediate_read_is_g1b() {
        let h = vec![
            t(vec![app(1, 1), app(1, 2)], 0, 1),
            t(vec![rd(1, &[1])], 2, 3),
        ];
        assert_eq!(names(&h), vec!["G1b"]);
    }

    #[test]
    fn missing_own_write_is_internal() {
        let h = vec![t(vec![app(1, 1), rd(1, &[])], 0, 1)];
        assert_eq!(names(&h), vec!["internal"]);
        let h = vec![t(vec![rd(1, &[]), app(1, 1), rd(1, &[1])], 0, 1)];
        assert!(check(&h).is_empty());
    }
}
