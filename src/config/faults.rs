//! `[faults]`: fault injection, for testing recovery.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// No fault (the default).
    None,
    /// The device's step returns an error, as a failed CUDA call would.
    Error,
    /// The device's thread panics, as cubecl does on many CUDA faults.
    Panic,
    /// The device's step never finishes, as a hung GPU would.
    Hang,
}

/// `[faults]`: fault injection for testing recovery. Off unless asked; fires once per
/// run (a restarted run does not fail again).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultsConfig {
    pub inject: FaultKind,
    /// Position, among the devices used, of the device that fails.
    pub device: usize,
    /// Optimizer step (1-based) during which it fails.
    pub step: u64,
}

impl Default for FaultsConfig {
    fn default() -> Self {
        Self {
            inject: FaultKind::None,
            device: 0,
            step: 1,
        }
    }
}

impl FaultsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.inject != FaultKind::None && self.step == 0 {
            return Err(ConfigError::invalid(
                "faults.step",
                0,
                "a step number from 1",
            ));
        }
        Ok(())
    }
}
