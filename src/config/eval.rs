//! `[eval]`: when the test split is evaluated.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

/// `[eval]`: the evaluator's schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// Evaluate on the test split every this many epochs (and after the last). 0: only
    /// after the last epoch.
    pub every_epochs: u32,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self { every_epochs: 1 }
    }
}

impl EvalConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(())
    }
}
