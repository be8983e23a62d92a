//! `[checkpoint]`: when training state is saved and how many are kept.

use serde::{Deserialize, Serialize};

use super::error::{ConfigError, at_most};

/// `[checkpoint]`: when training state is saved and how many are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Also save every this many optimizer steps. 0: only at the end of each epoch
    /// (and when training stops early).
    pub every_steps: u64,
    /// Keep the newest this many checkpoints; older ones are deleted once a newer one
    /// is complete on disk. At least 1.
    pub keep_last: usize,
    /// Also keep the checkpoint with the best test accuracy.
    pub keep_best: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every_steps: 0,
            keep_last: 2,
            keep_best: true,
        }
    }
}

impl CheckpointConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.keep_last == 0 {
            return Err(ConfigError::invalid(
                "checkpoint.keep_last",
                0,
                "at least 1 (resume needs a checkpoint)",
            ));
        }
        at_most(
            "checkpoint.keep_last",
            self.keep_last as u64,
            10_000,
            "checkpoints on disk",
        )
    }
}
