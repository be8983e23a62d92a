//! Which checkpoints to delete after a new one is complete. Pure policy, no I/O.

/// A complete checkpoint: its step and, when the test split was evaluated, its accuracy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    pub step: u64,
    pub test_acc: Option<f64>,
}

/// Steps to delete after step `saved` was written: all but the newest `keep_last` up to
/// it, and (with `keep_best`) the one with the best test accuracy, the earliest on
/// ties. A checkpoint newer than `saved` (left by an earlier attempt that got further)
/// is never deleted: only the user can decide it is not wanted.
pub fn to_delete(entries: &[Entry], saved: u64, keep_last: usize, keep_best: bool) -> Vec<u64> {
    let mut by_step: Vec<Entry> = entries
        .iter()
        .filter(|e| e.step <= saved)
        .copied()
        .collect();
    by_step.sort_by_key(|e| std::cmp::Reverse(e.step));
    let best = keep_best
        .then(|| {
            entries
                .iter()
                .filter_map(|e| e.test_acc.filter(|a| !a.is_nan()).map(|a| (a, e.step)))
                .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
                .map(|(_, step)| step)
        })
        .flatten();
    by_step
        .iter()
        .skip(keep_last.max(1))
        .map(|e| e.step)
        .filter(|s| Some(*s) != best)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(step: u64, acc: Option<f64>) -> Entry {
        Entry {
            step,
            test_acc: acc,
        }
    }

    #[test]
    fn keeps_the_newest_k_and_the_best() {
        let all = [
            e(10, Some(0.5)),
            e(20, Some(0.9)),
            e(30, Some(0.7)),
            e(40, None),
            e(50, Some(0.8)),
        ];
        let mut del = to_delete(&all, 50, 2, true);
        del.sort();
        assert_eq!(del, vec![10, 30]);
        let mut del = to_delete(&all, 50, 2, false);
        del.sort();
        assert_eq!(del, vec![10, 20, 30]);
    }

    #[test]
    fn never_deletes_everything_and_prefers_the_earliest_best_on_ties() {
        assert!(to_delete(&[e(1, None)], 1, 0, false).is_empty());
        let del = to_delete(
            &[e(1, Some(0.9)), e(2, Some(0.9)), e(3, Some(0.1))],
            3,
            1,
            true,
        );
        assert_eq!(del, vec![2]);
    }

    #[test]
    fn a_checkpoint_newer_than_the_one_just_saved_is_never_deleted() {
        // An earlier attempt got to step 900; this one resumed from 300 and saved 400.
        let all = [e(100, None), e(300, None), e(400, None), e(900, None)];
        let mut del = to_delete(&all, 400, 2, false);
        del.sort();
        assert_eq!(del, vec![100]);
    }
}
