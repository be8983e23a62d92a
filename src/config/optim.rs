//! `[optim]`: optimizer and learning-rate schedule.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// SGD with (optionally Nesterov) momentum and L2 weight decay, as `torch.optim.SGD`.
    Sgd,
    /// Adam with decoupled weight decay, as `torch.optim.AdamW`.
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// `lr` throughout (after warmup).
    Constant,
    /// Half-cosine from `lr` down to `min_lr` over the run (after warmup).
    Cosine,
    /// 1cycle (Smith 2018): cosine up from `lr / onecycle_div` to `lr` over
    /// `onecycle_pct_start` of the run, then cosine down to `lr / onecycle_final_div`.
    Onecycle,
    /// Multiply by `step_gamma` at each epoch in `step_milestones`.
    Step,
}

/// `[optim]`: optimizer and learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub name: OptimizerKind,
    /// Peak learning rate.
    pub lr: f64,
    /// SGD momentum (dampening 0, as PyTorch).
    pub momentum: f64,
    /// SGD: Nesterov momentum.
    pub nesterov: bool,
    /// SGD: L2 penalty added to the gradient. AdamW: decoupled decay rate.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    pub schedule: ScheduleKind,
    /// Linear warmup from 0 over this many epochs (fractions allowed). Not used by `onecycle`.
    pub warmup_epochs: f64,
    /// `cosine`: the final learning rate.
    pub min_lr: f64,
    /// `step`: epochs at which the learning rate is multiplied by `step_gamma`.
    pub step_milestones: Vec<u32>,
    /// `step`: the factor applied at each milestone.
    pub step_gamma: f64,
    /// `onecycle`: fraction of the run spent increasing the learning rate.
    pub onecycle_pct_start: f64,
    /// `onecycle`: initial learning rate is `lr / onecycle_div`.
    pub onecycle_div: f64,
    /// `onecycle`: final learning rate is `lr / onecycle_final_div`.
    pub onecycle_final_div: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            name: OptimizerKind::Sgd,
            lr: 0.1,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 5e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            schedule: ScheduleKind::Cosine,
            warmup_epochs: 0.0,
            min_lr: 0.0,
            step_milestones: Vec::new(),
            step_gamma: 0.1,
            onecycle_pct_start: 0.3,
            onecycle_div: 25.0,
            onecycle_final_div: 1e4,
        }
    }
}

impl OptimConfig {
    /// `epochs`: `train.epochs`, which bounds the warmup.
    pub fn validate(&self, epochs: u32) -> Result<(), ConfigError> {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(ConfigError::invalid(
                "optim.lr",
                self.lr,
                "a positive number",
            ));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(ConfigError::invalid(
                "optim.momentum",
                self.momentum,
                "a number in [0, 1)",
            ));
        }
        if self.nesterov && self.momentum == 0.0 {
            return Err(ConfigError::invalid(
                "optim.nesterov",
                "true",
                "false when optim.momentum = 0 (Nesterov needs momentum)",
            ));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(ConfigError::invalid(
                "optim.weight_decay",
                self.weight_decay,
                "0 or a positive number",
            ));
        }
        for (key, v) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(ConfigError::invalid(key, v, "a number in [0, 1)"));
            }
        }
        if self.eps.is_nan() || self.eps <= 0.0 {
            return Err(ConfigError::invalid(
                "optim.eps",
                self.eps,
                "a positive number",
            ));
        }
        if !(self.warmup_epochs >= 0.0 && self.warmup_epochs <= epochs as f64) {
            return Err(ConfigError::invalid(
                "optim.warmup_epochs",
                self.warmup_epochs,
                format!("a number from 0 to train.epochs = {epochs}"),
            ));
        }
        if !(self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(ConfigError::invalid(
                "optim.min_lr",
                self.min_lr,
                format!("from 0 to optim.lr = {}", self.lr),
            ));
        }
        if self.step_gamma.is_nan() || self.step_gamma <= 0.0 {
            return Err(ConfigError::invalid(
                "optim.step_gamma",
                self.step_gamma,
                "a positive number",
            ));
        }
        if self.step_milestones.len() > 10_000 {
            return Err(ConfigError::invalid(
                "optim.step_milestones",
                format!("{} entries", self.step_milestones.len()),
                "at most 10000 epochs",
            ));
        }
        if self.schedule == ScheduleKind::Step {
            if self.step_milestones.windows(2).any(|w| w[0] >= w[1]) {
                return Err(ConfigError::invalid(
                    "optim.step_milestones",
                    format!("{:?}", self.step_milestones),
                    "epochs in increasing order",
                ));
            }
            if self.step_milestones.is_empty() {
                return Err(ConfigError::invalid(
                    "optim.step_milestones",
                    "[]",
                    "at least one epoch when optim.schedule = \"step\"",
                ));
            }
        }
        if !(self.onecycle_pct_start > 0.0 && self.onecycle_pct_start < 1.0) {
            return Err(ConfigError::invalid(
                "optim.onecycle_pct_start",
                self.onecycle_pct_start,
                "a number in (0, 1)",
            ));
        }
        for (key, v) in [
            ("optim.onecycle_div", self.onecycle_div),
            ("optim.onecycle_final_div", self.onecycle_final_div),
        ] {
            if v.is_nan() || v < 1.0 {
                return Err(ConfigError::invalid(key, v, "a number of at least 1"));
            }
        }
        Ok(())
    }
}
