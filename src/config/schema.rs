//! The whole configuration: one section per component, each in its own file with its
//! own `validate`, every field with its unit, default and interactions. This is what
//! the user typed (after `--set`); resolving it against the machine (devices, dataset
//! files) happens elsewhere. Each component is handed only its own section.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::{
    CheckpointConfig, DataConfig, DevicesConfig, EvalConfig, FaultsConfig, KernelsConfig,
    ModelConfig, OptimConfig, ParallelConfig, TrainConfig, WatchdogConfig,
};

/// The whole training configuration, as read from a TOML file plus `--set` overrides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub eval: EvalConfig,
    pub optim: OptimConfig,
    pub kernels: KernelsConfig,
    pub parallel: ParallelConfig,
    pub devices: DevicesConfig,
    pub checkpoint: CheckpointConfig,
    pub watchdog: WatchdogConfig,
    pub faults: FaultsConfig,
}

/// Keys that moved to another section, old spelling first: an old spelling is an error
/// that names the new one.
pub const MOVED_KEYS: &[(&str, &str)] = &[
    ("train.eval_every_epochs", "eval.every_epochs"),
    ("train.autotune", "kernels.autotune"),
    ("train.convolution", "kernels.convolution"),
    ("train.batch_norm", "kernels.batch_norm"),
    ("train.channels_last", "kernels.channels_last"),
    (
        "train.gradient_checkpointing",
        "kernels.gradient_checkpointing",
    ),
    ("train.strategy", "parallel.strategy"),
    ("train.transfer_bucket_mib", "parallel.bucket_mib"),
    ("train.device_weights", "parallel.device_weights"),
    ("train.sync_batchnorm", "parallel.sync_batchnorm"),
    ("train.hang_timeout_s", "watchdog.hang_timeout_s"),
];

impl Config {
    /// SHA-256 of what decides the training's numbers: everything but where it runs
    /// (`[devices]`), how it is watched (`[watchdog]`) and `[faults]`, so a restart on
    /// fewer GPUs keeps the hash. Every rank of a multi-process run must agree on it.
    pub fn training_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let training = Config {
            devices: DevicesConfig::default(),
            watchdog: WatchdogConfig::default(),
            faults: FaultsConfig::default(),
            ..self.clone()
        };
        let text = toml::to_string(&training).unwrap_or_else(|e| format!("{training:?} {e}"));
        Sha256::digest(text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Every section's own rules, then those that involve more than one section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.train.validate()?;
        self.eval.validate()?;
        self.data.validate()?;
        self.optim.validate(self.train.epochs)?;
        self.kernels.validate()?;
        self.parallel.validate()?;
        self.devices.validate()?;
        self.checkpoint.validate()?;
        self.watchdog.validate()?;
        self.faults.validate()?;
        // Early stopping reads the test accuracy, measured every eval.every_epochs.
        let (patience, every) = (self.train.early_stop_patience, self.eval.every_epochs);
        if patience > 0 && every == 0 {
            return Err(ConfigError::invalid(
                "train.early_stop_patience",
                patience,
                "0 (off) while eval.every_epochs = 0 evaluates only after the last epoch: set eval.every_epochs to evaluate during training",
            ));
        }
        if patience > 0 && patience < every {
            return Err(ConfigError::invalid(
                "train.early_stop_patience",
                patience,
                format!(
                    "0 (off) or at least eval.every_epochs = {every}: the test accuracy is measured only every {every} epochs"
                ),
            ));
        }
        Ok(())
    }
}
