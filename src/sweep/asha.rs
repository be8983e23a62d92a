//! Asynchronous successive halving (ASHA, stopping variant): rungs at `min_epochs`,
//! `min_epochs * reduction`, ... epochs. When a trial reaches a rung its test metric is
//! compared with those of the trials that reached that rung before it; it trains on only
//! if it is among the best `1/reduction` of them. Nothing waits for a rung to fill, so
//! slots never idle, and early trials are judged against fewer peers (the first always
//! goes on). This module only decides; starting and stopping trials is the runner's job.

use serde::{Deserialize, Serialize};

use super::spec::Goal;

/// `[asha]` of a sweep file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AshaSpec {
    /// Epochs of the first rung.
    #[serde(default = "one")]
    pub min_epochs: u32,
    /// Each rung keeps the best 1/reduction of the trials that reached it, and the next
    /// rung is reduction times as many epochs.
    #[serde(default = "three")]
    pub reduction: u32,
}

impl AshaSpec {
    /// Checks the values against the trials' `epochs`, so that a bad file fails before
    /// anything trains rather than silently stopping nothing.
    pub fn validate(&self, epochs: u32) -> Result<(), String> {
        if self.min_epochs == 0 {
            return Err("asha.min_epochs = 0: at least 1".into());
        }
        if self.reduction < 2 {
            return Err(format!(
                "asha.reduction = {}: at least 2 (1 would never stop a trial)",
                self.reduction
            ));
        }
        if self.min_epochs >= epochs {
            return Err(format!(
                "asha.min_epochs = {} is not below epochs = {epochs}: lower it (or raise epochs) so that there is a rung before the end",
                self.min_epochs
            ));
        }
        Ok(())
    }

    /// The rungs' epoch counts below `epochs`: `min_epochs * reduction^k` for k = 0, 1, ...
    /// The last epoch is no rung: a trial that gets there is done anyway. Empty for values
    /// `validate` refuses, which would otherwise never grow.
    pub fn rungs(&self, epochs: u32) -> Vec<u32> {
        let mut out = Vec::new();
        if self.min_epochs == 0 || self.reduction < 2 {
            return out;
        }
        let mut e = Some(self.min_epochs);
        while let Some(x) = e.filter(|&x| x < epochs) {
            out.push(x);
            e = x.checked_mul(self.reduction);
        }
        out
    }
}

/// Per rung, the metric each trial had when it reached it.
#[derive(Debug, Clone, Default)]
pub struct Rungs {
    /// `(rung epoch, [(trial, metric)])`, rungs ascending, records in arrival order.
    rungs: Vec<(u32, Vec<(usize, f64)>)>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    Continue,
    /// Stopped at `rung`: `cutoff` is the value it had to match (NaN: the metric was not
    /// finite).
    Stop {
        rung: u32,
        cutoff: f64,
    },
}

impl Rungs {
    pub fn new(rung_epochs: &[u32]) -> Self {
        let mut epochs = rung_epochs.to_vec();
        epochs.sort_unstable();
        epochs.dedup();
        Rungs {
            rungs: epochs.into_iter().map(|e| (e, Vec::new())).collect(),
        }
    }

    /// Records that `trial` finished epoch `epoch` with `metric` (a test metric of that
    /// epoch), and decides whether it trains on.
    ///
    /// Only rung epochs matter; any other epoch continues without a record. A trial keeps
    /// its first record at a rung (a restarted trial may report again): a repeat is judged
    /// on that first value against the rung as it is now, so it cannot buy a second chance.
    /// A non-finite metric stops the trial (it diverged) and is not recorded, as it says
    /// nothing about where the cutoff should be.
    pub fn report(
        &mut self,
        trial: usize,
        epoch: u32,
        metric: f64,
        goal: Goal,
        reduction: u32,
    ) -> Decision {
        let Some((_, records)) = self.rungs.iter_mut().find(|(e, _)| *e == epoch) else {
            return Decision::Continue;
        };
        let metric = match records.iter().find(|(t, _)| *t == trial) {
            Some(&(_, first)) => first,
            None if !metric.is_finite() => {
                return Decision::Stop {
                    rung: epoch,
                    cutoff: f64::NAN,
                };
            }
            None => {
                records.push((trial, metric));
                metric
            }
        };
        decide(records, epoch, metric, goal, reduction)
    }

    /// Records what `trial` had at rung `epoch` without deciding anything: a resumed
    /// sweep's rungs rebuilt from its trials' files (a trial keeps its first record).
    pub fn record(&mut self, trial: usize, epoch: u32, metric: f64) {
        if let Some((_, records)) = self.rungs.iter_mut().find(|(e, _)| *e == epoch)
            && metric.is_finite()
            && !records.iter().any(|(t, _)| *t == trial)
        {
            records.push((trial, metric));
        }
    }

    /// How many trials have been recorded at each rung: `(rung epoch, count)`.
    pub fn counts(&self) -> Vec<(u32, usize)> {
        self.rungs.iter().map(|(e, r)| (*e, r.len())).collect()
    }
}

/// Continue if fewer than `keep = max(1, n / reduction)` recorded values are strictly
/// better than `metric` (ties go the trial's way); else stop at the keep-th best value.
fn decide(
    records: &[(usize, f64)],
    rung: u32,
    metric: f64,
    goal: Goal,
    reduction: u32,
) -> Decision {
    let keep = (records.len() / reduction.max(1) as usize).max(1);
    let better = |a: f64, b: f64| match goal {
        Goal::Max => a > b,
        Goal::Min => a < b,
    };
    if records.iter().filter(|(_, m)| better(*m, metric)).count() < keep {
        return Decision::Continue;
    }
    let mut values: Vec<f64> = records.iter().map(|(_, m)| *m).collect();
    values.sort_unstable_by(|a, b| match goal {
        Goal::Max => b.total_cmp(a),
        Goal::Min => a.total_cmp(b),
    });
    Decision::Stop {
        rung,
        cutoff: values[keep - 1],
    }
}

fn one() -> u32 {
    1
}
fn three() -> u32 {
    3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(min_epochs: u32, reduction: u32) -> AshaSpec {
        AshaSpec {
            min_epochs,
            reduction,
        }
    }

    #[test]
    fn rungs_grow_by_reduction_below_epochs() {
        assert_eq!(spec(1, 3).rungs(9), vec![1, 3]);
        assert_eq!(spec(1, 3).rungs(10), vec![1, 3, 9]);
        assert_eq!(spec(2, 2).rungs(12), vec![2, 4, 8]);
        assert_eq!(spec(1, 3).rungs(1), Vec::<u32>::new());
        assert_eq!(spec(1, 1).rungs(10), Vec::<u32>::new());
    }

    #[test]
    fn validate_names_the_bad_key() {
        assert_eq!(spec(1, 3).validate(10), Ok(()));
        let e = spec(1, 1).validate(10).unwrap_err();
        assert!(e.contains("asha.reduction = 1"), "{e}");
        let e = spec(0, 3).validate(10).unwrap_err();
        assert!(e.contains("asha.min_epochs = 0"), "{e}");
        let e = spec(10, 3).validate(10).unwrap_err();
        assert!(e.contains("asha.min_epochs = 10"), "{e}");
        assert!(spec(11, 3).validate(10).is_err());
    }

    #[test]
    fn spec_defaults_and_unknown_keys() {
        let s: AshaSpec = toml::from_str("").unwrap();
        assert_eq!(s, spec(1, 3));
        let s: AshaSpec = toml::from_str("reduction = 4").unwrap();
        assert_eq!(s, spec(1, 4));
        assert!(toml::from_str::<AshaSpec>("eta = 4").is_err());
    }

    #[test]
    fn report_max_keeps_the_best_third() {
        let mut r = Rungs::new(&[1, 3]);
        let mut rep = |t, m| r.report(t, 1, m, Goal::Max, 3);
        assert_eq!(rep(0, 0.5), Decision::Continue);
        assert_eq!(
            rep(1, 0.4),
            Decision::Stop {
                rung: 1,
                cutoff: 0.5
            }
        );
        assert_eq!(rep(2, 0.6), Decision::Continue);
        assert_eq!(
            rep(3, 0.55),
            Decision::Stop {
                rung: 1,
                cutoff: 0.6
            }
        );
        assert_eq!(
            rep(4, 0.1),
            Decision::Stop {
                rung: 1,
                cutoff: 0.6
            }
        );
        // n = 6, keep = 2: only 0.6 is better than 0.58.
        assert_eq!(rep(5, 0.58), Decision::Continue);
        // n = 7, keep = 2: a tie with the keep-th best goes the trial's way.
        assert_eq!(rep(6, 0.58), Decision::Continue);
        assert_eq!(r.counts(), vec![(1, 7), (3, 0)]);
    }

    #[test]
    fn report_min_prefers_lower() {
        let mut r = Rungs::new(&[2]);
        assert_eq!(r.report(0, 2, 1.0, Goal::Min, 2), Decision::Continue);
        // n = 2, keep = 1: 1.0 is the best.
        assert_eq!(
            r.report(1, 2, 2.0, Goal::Min, 2),
            Decision::Stop {
                rung: 2,
                cutoff: 1.0
            }
        );
        assert_eq!(r.report(2, 2, 0.5, Goal::Min, 2), Decision::Continue);
        // n = 4, keep = 2: the cutoff is the second lowest.
        assert_eq!(
            r.report(3, 2, 3.0, Goal::Min, 2),
            Decision::Stop {
                rung: 2,
                cutoff: 1.0
            }
        );
    }

    #[test]
    fn non_rung_epoch_records_nothing() {
        let mut r = Rungs::new(&[1, 3]);
        assert_eq!(r.report(0, 2, 0.0, Goal::Max, 3), Decision::Continue);
        assert_eq!(r.report(0, 5, f64::NAN, Goal::Max, 3), Decision::Continue);
        assert_eq!(r.counts(), vec![(1, 0), (3, 0)]);
    }

    #[test]
    fn non_finite_metric_stops() {
        let mut r = Rungs::new(&[1]);
        for m in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            match r.report(0, 1, m, Goal::Max, 3) {
                Decision::Stop { rung: 1, cutoff } => assert!(cutoff.is_nan()),
                d => panic!("{m}: {d:?}"),
            }
        }
        assert_eq!(r.counts(), vec![(1, 0)]);
    }

    #[test]
    fn repeat_keeps_the_first_record() {
        let mut r = Rungs::new(&[1]);
        assert_eq!(r.report(0, 1, 0.5, Goal::Max, 3), Decision::Continue);
        assert_eq!(r.report(1, 1, 0.9, Goal::Max, 3), Decision::Continue);
        // Trial 0 again with a better value: still judged on 0.5, now behind 0.9.
        assert_eq!(
            r.report(0, 1, 1.0, Goal::Max, 3),
            Decision::Stop {
                rung: 1,
                cutoff: 0.9
            }
        );
        assert_eq!(r.counts(), vec![(1, 2)]);
    }

    #[test]
    fn best_trial_is_never_stopped_in_any_order() {
        let metric = |i: usize| ((i * 7) % 27) as f64;
        let by_metric: Vec<usize> = {
            let mut v: Vec<usize> = (0..27).collect();
            v.sort_by(|&a, &b| metric(a).total_cmp(&metric(b)));
            v
        };
        let orders = [
            by_metric.clone(),
            by_metric.iter().rev().copied().collect(),
            (0..27).collect::<Vec<_>>(),
            (0..27).map(|i| (i * 5) % 27).collect(),
        ];
        // Arriving from worst to best stops nothing, so count over all orders.
        let mut stopped = 0;
        for (goal, best) in [(Goal::Max, 26.0), (Goal::Min, 0.0)] {
            for order in &orders {
                let mut r = Rungs::new(&[1]);
                for &t in order {
                    let d = r.report(t, 1, metric(t), goal, 3);
                    if d != Decision::Continue {
                        assert_ne!(metric(t), best, "{goal:?} {order:?}: {d:?}");
                        stopped += 1;
                    }
                }
                assert_eq!(r.counts(), vec![(1, 27)]);
            }
        }
        assert!(stopped > 0, "nothing stopped");
    }
}
