//! When throughput came back after a failure, from transactions completed per millisecond: what
//! the in-process failure runs (`benchmarks`) and `farm-node local ... --kill-after` report,
//! as the paper's Figures 9 to 11 do (suspicion to 80% of the throughput before).

/// Milliseconds over which throughput must be back to count as recovered.
pub const WINDOW_MS: usize = 5;

/// Milliseconds before a failure whose mean throughput is the baseline.
pub const BASELINE_MS: usize = 100;

/// The first millisecond at or after `from_ms` that starts a [`WINDOW_MS`] window whose mean
/// is at least `fraction` of `baseline` (operations per millisecond).
pub fn back_to(per_ms: &[u64], from_ms: usize, baseline: f64, fraction: f64) -> Option<usize> {
    (from_ms..per_ms.len().saturating_sub(WINDOW_MS)).find(|&ms| {
        let w: u64 = per_ms[ms..ms + WINDOW_MS].iter().sum();
        w as f64 / WINDOW_MS as f64 >= fraction * baseline
    })
}

/// Mean operations per millisecond over the `ms` milliseconds before `until_ms`, if there
/// were that many.
pub fn mean_before(per_ms: &[u64], until_ms: usize, ms: usize) -> Option<f64> {
    let from = until_ms.checked_sub(ms)?;
    let window = per_ms.get(from..until_ms)?;
    Some(window.iter().sum::<u64>() as f64 / ms as f64)
}

/// How a run recovered from a failure at millisecond `failed_ms` of `per_ms` that was
/// suspected at millisecond `suspected_ms` (if it was): the throughput before (mean over the
/// [`BASELINE_MS`] before the failure) and the milliseconds from the suspicion to the first
/// [`WINDOW_MS`] window at 80% of it.
pub fn recovery(per_ms: &[u64], failed_ms: usize, suspected_ms: Option<usize>) -> Recovery {
    let before = mean_before(per_ms, failed_ms, BASELINE_MS);
    let back = match (suspected_ms, before) {
        (Some(s), Some(b)) => back_to(per_ms, s, b, 0.8).map(|ms| ms - s),
        _ => None,
    };
    Recovery {
        before_per_ms: before,
        suspected_to_80_percent_ms: back,
    }
}

/// See [`recovery`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recovery {
    /// Operations per millisecond before the failure.
    pub before_per_ms: Option<f64>,
    /// From the suspicion to 80% of that.
    pub suspected_to_80_percent_ms: Option<usize>,
}

/// The suspicions (machine, when) of machines that were alive then: all but those of a machine
/// of `failed` (machine, when it failed) at or after its failure, each once (a lease expiry
/// may be recorded by more than one path), in order. A lease a run holds is one with none.
pub fn false_suspicions(
    suspected: impl IntoIterator<Item = (u16, u64)>,
    failed: &[(u16, u64)],
) -> Vec<(u16, u64)> {
    let of_the_failure = |m: u16, at: u64| failed.iter().any(|&(f, t)| f == m && at >= t);
    let mut live: Vec<(u16, u64)> = (suspected.into_iter())
        .filter(|&(m, at)| !of_the_failure(m, at))
        .collect();
    live.sort_by_key(|&(m, at)| (at, m));
    live.dedup();
    live
}

/// The report line of [`false_suspicions`], each `listed` as its report words it: the line
/// `scripts/deployments.sh` counts them from.
pub fn false_suspicions_line(listed: &[String]) -> String {
    let listed = if listed.is_empty() {
        "none".to_string()
    } else {
        listed.join(", ")
    };
    format!("suspicions of live machines: {listed}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_false_suspicion_is_one_of_a_machine_alive_then() {
        let failed = [(2, 1_000)];
        let suspected = [(2, 1_200), (1, 1_300), (2, 400), (1, 1_300), (0, 50)];
        assert_eq!(
            false_suspicions(suspected, &failed),
            vec![(0, 50), (2, 400), (1, 1_300)],
            "machine 2 before its failure, the others at any time, each once"
        );
        assert_eq!(false_suspicions([(2, 1_000)], &failed), vec![]);
        assert_eq!(false_suspicions([(2, 1_000)], &[]), vec![(2, 1_000)]);
    }

    #[test]
    fn recovery_is_timed_from_the_suspicion_to_a_window_at_80_percent() {
        // 10 per ms, a failure at 200, nothing until 240, then 9 (a window from 239 holds 36,
        // under 8 per ms; from 240, 45).
        let per_ms: Vec<u64> = (0..400)
            .map(|ms| match ms {
                ..200 => 10,
                200..240 => 0,
                _ => 9,
            })
            .collect();
        let r = recovery(&per_ms, 200, Some(210));
        assert_eq!(r.before_per_ms, Some(10.0));
        assert_eq!(
            r.suspected_to_80_percent_ms,
            Some(30),
            "the first window at 8 starts at 240"
        );
        assert_eq!(
            recovery(&per_ms, 200, None).suspected_to_80_percent_ms,
            None
        );
        assert_eq!(
            recovery(&per_ms, 50, Some(60)).before_per_ms,
            None,
            "no 100 ms before"
        );
    }
}
