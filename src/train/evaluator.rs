//! The evaluator: given only `[eval]` and the test loader, it knows when a test pass
//! is due (every `eval.every_epochs` epochs and after the last) and runs it, on the
//! main device with BatchNorm in inference mode, adding up the shards of every process.

use burn::module::AutodiffModule;

use super::error::TrainError;
use super::learner::Learner;
use super::step::{Sums, eval_batch};
use crate::config::EvalConfig;
use crate::data::{DataError, Loader};
use crate::model::ResNet;
use crate::ops::{ModelBackend, TrainBackend};

pub struct Evaluator {
    every_epochs: u32,
    test: Loader,
}

impl Evaluator {
    pub fn new(cfg: &EvalConfig, test: Loader) -> Self {
        Evaluator {
            every_epochs: cfg.every_epochs,
            test,
        }
    }

    /// Whether a test pass is due after epoch `epoch` (1-based); `last`: the run ends
    /// after it.
    pub fn is_due(&self, epoch: u32, last: bool) -> bool {
        last || (self.every_epochs > 0 && epoch.is_multiple_of(self.every_epochs))
    }

    /// Mean test loss and accuracy after epoch `epoch` (at step `step`) when due, NaN
    /// otherwise (and NaN without images).
    pub fn maybe_run<B: TrainBackend>(
        &self,
        epoch: u32,
        step: u64,
        last: bool,
        learner: &mut Learner<B>,
        device: &B::Device,
    ) -> Result<(f64, f64), TrainError> {
        if !self.is_due(epoch, last) {
            return Ok((f64::NAN, f64::NAN));
        }
        let t = std::time::Instant::now();
        learner.sync_buffers(step)?;
        let totals =
            evaluate_totals::<B::InnerBackend>(&learner.model().valid(), &self.test, device)?;
        let during = format!("epoch {epoch}'s test pass");
        let totals = learner.strategy().sum_over_processes(totals, &during)?;
        crate::detail!(
            "kiln: test pass of epoch {epoch}: {} images in {:.2} s",
            totals.2,
            t.elapsed().as_secs_f64()
        );
        Ok(means_or_nan(totals))
    }
}

/// Mean loss and accuracy of `model` over every batch of `loader`.
pub fn evaluate<B: ModelBackend>(
    model: &ResNet<B>,
    loader: &Loader,
    device: &B::Device,
) -> Result<(f64, f64), DataError> {
    Ok(means_or_nan(evaluate_totals(model, loader, device)?))
}

/// Mean loss and accuracy of `(loss × images, correct, images)`; NaN without images.
pub fn means_or_nan((loss, correct, images): (f64, f64, usize)) -> (f64, f64) {
    if images > 0 {
        (loss / images as f64, correct / images as f64)
    } else {
        (f64::NAN, f64::NAN)
    }
}

/// `(loss × images, correct, images)` of `model` over every batch of `loader` (a
/// shard's batches may be empty).
pub fn evaluate_totals<B: ModelBackend>(
    model: &ResNet<B>,
    loader: &Loader,
    device: &B::Device,
) -> Result<(f64, f64, usize), DataError> {
    let mut sums: Option<Sums<B>> = None;
    for batch in loader.epoch(0, 0) {
        let batch = batch?;
        if batch.labels.is_empty() {
            continue;
        }
        sums = Sums::accumulate(sums, eval_batch(model, batch, device));
    }
    Ok(sums.map(Sums::totals).unwrap_or((0.0, 0.0, 0)))
}
