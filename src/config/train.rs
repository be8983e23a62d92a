//! `[train]`: the loop: how long, on what batches, with what loss and arithmetic.

use serde::{Deserialize, Serialize};

use super::error::{ConfigError, at_most};

/// Number format of the training arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// f32 everywhere (Burn runs f32 matmuls as TF32 on the tensor cores).
    Fp32,
    /// Mixed precision: convolutions and the classifier in bfloat16 on fp32 master
    /// weights; BatchNorm, loss and optimizer in fp32 (`model::precision`).
    Bf16,
    /// The same in float16, with dynamic loss scaling (`train::loss_scale`).
    Fp16,
}

/// `[train]`: the loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Passes over the training set.
    pub epochs: u32,
    /// Stop after this many optimizer steps, even mid-epoch (a checkpoint is written).
    /// 0: run all epochs. The LR schedule is still laid out over all epochs.
    pub max_steps: u64,
    /// Images per optimizer step (the global batch), whatever the number of devices
    /// and accumulation steps. The last, smaller batch of an epoch is dropped.
    pub batch_size: usize,
    /// Split each global batch into this many micro-batches whose gradients are summed
    /// before one optimizer step. Must divide `batch_size`.
    pub grad_accum_steps: usize,
    /// Seeds weight initialisation, data order and augmentation. The same seed on the
    /// CPU gives the same run.
    pub seed: u64,
    /// Cross-entropy label smoothing in [0, 1).
    pub label_smoothing: f64,
    /// Clip the global L2 norm of all gradients to this value. 0: off.
    pub grad_clip_norm: f64,
    /// Print a progress line every this many steps when stderr is not a terminal.
    pub log_every_steps: u64,
    /// Number format of the training arithmetic: `fp32`, or `bf16` / `fp16` mixed precision.
    pub precision: Precision,
    /// Require bitwise-repeatable training: the same seed gives the same weights on the
    /// same device. The CPU backend is; CUDA runs are refused (`cmd::train` says why).
    pub deterministic: bool,
    /// End the run once the test accuracy has not improved for this many epochs
    /// (evaluated or not). 0: off.
    pub early_stop_patience: u32,
    /// How much higher a test accuracy must be to count as an improvement (a fraction:
    /// 0.001 is a tenth of a point).
    pub early_stop_min_delta: f64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            epochs: 30,
            max_steps: 0,
            batch_size: 128,
            grad_accum_steps: 1,
            seed: 0,
            label_smoothing: 0.0,
            grad_clip_norm: 0.0,
            log_every_steps: 100,
            precision: Precision::Fp32,
            deterministic: false,
            early_stop_patience: 0,
            early_stop_min_delta: 0.0,
        }
    }
}

/// Images per global batch at most: a batch is made whole in host memory.
pub const MAX_BATCH: usize = 1 << 20;
/// Epochs at most: the per-epoch history is kept in every checkpoint.
pub const MAX_EPOCHS: u32 = 100_000;

impl TrainConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.epochs == 0 {
            return Err(ConfigError::invalid("train.epochs", 0, "at least 1"));
        }
        at_most(
            "train.epochs",
            self.epochs as u64,
            MAX_EPOCHS as u64,
            "each epoch is a row of the history every checkpoint keeps",
        )?;
        if self.batch_size == 0 {
            return Err(ConfigError::invalid("train.batch_size", 0, "at least 1"));
        }
        at_most(
            "train.batch_size",
            self.batch_size as u64,
            MAX_BATCH as u64,
            "images of one step, made whole in host memory",
        )?;
        if self.grad_accum_steps == 0 || !self.batch_size.is_multiple_of(self.grad_accum_steps) {
            return Err(ConfigError::invalid(
                "train.grad_accum_steps",
                self.grad_accum_steps,
                format!(
                    "a divisor of train.batch_size = {} (each micro-batch has batch_size / grad_accum_steps images)",
                    self.batch_size
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return Err(ConfigError::invalid(
                "train.label_smoothing",
                self.label_smoothing,
                "a number in [0, 1)",
            ));
        }
        if !(self.grad_clip_norm >= 0.0 && self.grad_clip_norm.is_finite()) {
            return Err(ConfigError::invalid(
                "train.grad_clip_norm",
                self.grad_clip_norm,
                "0 (off) or a positive number",
            ));
        }
        at_most(
            "train.early_stop_patience",
            self.early_stop_patience as u64,
            MAX_EPOCHS as u64,
            "a number of epochs",
        )?;
        if !(0.0..1.0).contains(&self.early_stop_min_delta) {
            return Err(ConfigError::invalid(
                "train.early_stop_min_delta",
                self.early_stop_min_delta,
                "a fraction of accuracy in [0, 1), e.g. 0.001",
            ));
        }
        if self.log_every_steps == 0 {
            return Err(ConfigError::invalid(
                "train.log_every_steps",
                0,
                "at least 1",
            ));
        }
        Ok(())
    }
}
