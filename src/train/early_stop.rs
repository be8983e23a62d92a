//! Early stopping: a run ends once its test accuracy has not improved for
//! `train.early_stop_patience` epochs. Decided from the epoch history alone, which every
//! checkpoint keeps, so a resumed run decides as the uninterrupted one would have.

use crate::config::TrainConfig;
use crate::report::EpochRecord;

pub struct EarlyStop {
    /// Epochs without a better test accuracy that end the run; 0: never.
    patience: u32,
    /// How much higher a test accuracy must be to count as better (a fraction).
    min_delta: f64,
}

impl EarlyStop {
    pub fn new(train: &TrainConfig) -> Self {
        EarlyStop {
            patience: train.early_stop_patience,
            min_delta: train.early_stop_min_delta,
        }
    }

    /// Why the run ends after `history`, or `None` while it goes on. Epochs count
    /// whether the test split was evaluated after them or not.
    pub fn reason(&self, history: &[EpochRecord]) -> Option<String> {
        if self.patience == 0 {
            return None;
        }
        let mut best: Option<&EpochRecord> = None;
        for r in history.iter().filter(|r| !r.test_acc.is_nan()) {
            if best.is_none_or(|b| r.test_acc > b.test_acc + self.min_delta) {
                best = Some(r);
            }
        }
        let best = best?;
        let since = history.last()?.epoch - best.epoch;
        (since >= self.patience).then(|| {
            format!(
                "early stop: test accuracy not above {:.2}% (epoch {}) by {} for {since} epochs (train.early_stop_patience = {})",
                best.test_acc * 100.0,
                best.epoch,
                self.min_delta,
                self.patience
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(accs: &[f64]) -> Vec<EpochRecord> {
        accs.iter()
            .enumerate()
            .map(|(i, &a)| EpochRecord {
                epoch: i as u32 + 1,
                step: (i as u64 + 1) * 10,
                lr: 0.1,
                train_loss: 1.0,
                train_acc: 0.5,
                test_loss: if a.is_nan() { f64::NAN } else { 1.0 - a },
                test_acc: a,
                img_per_s: 100.0,
                epoch_time_s: 1.0,
                data_wait_s: 0.0,
            })
            .collect()
    }

    fn stop(patience: u32, min_delta: f64) -> EarlyStop {
        EarlyStop {
            patience,
            min_delta,
        }
    }

    #[test]
    fn stops_after_patience_epochs_without_a_better_accuracy() {
        let s = stop(2, 0.0);
        assert_eq!(s.reason(&history(&[0.5, 0.6, 0.6])), None);
        let why = s.reason(&history(&[0.5, 0.6, 0.6, 0.59])).unwrap();
        assert!(
            why.contains("60.00% (epoch 2)") && why.contains("for 2 epochs"),
            "{why}"
        );
        // A better epoch starts the count again.
        assert_eq!(s.reason(&history(&[0.5, 0.6, 0.6, 0.61])), None);
    }

    #[test]
    fn a_gain_below_min_delta_is_no_gain_and_off_is_never() {
        let h = history(&[0.5, 0.6, 0.605, 0.609]);
        assert!(stop(2, 0.01).reason(&h).is_some());
        assert_eq!(stop(2, 0.0).reason(&h), None);
        assert_eq!(stop(0, 0.0).reason(&history(&[0.9, 0.1, 0.1, 0.1])), None);
    }

    #[test]
    fn unevaluated_epochs_count_and_no_evaluation_never_stops() {
        let nan = f64::NAN;
        assert!(
            stop(2, 0.0)
                .reason(&history(&[0.5, nan, 0.4, nan]))
                .is_some()
        );
        assert_eq!(stop(2, 0.0).reason(&history(&[0.5, nan, 0.6, nan])), None);
        assert_eq!(stop(1, 0.0).reason(&history(&[nan, nan, nan])), None);
    }
}
