//! `[watchdog]`: when a step counts as hung.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

/// `[watchdog]`: the step watchdog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WatchdogConfig {
    /// A step that takes longer than this many seconds counts as a hang: the process
    /// records which device it waited for, aborts its collectives and exits (75) so the
    /// supervisor restarts it. 0: automatic (the larger of 300 s and 50 times the
    /// median step). The first step of a process (kernel compilation) is not watched.
    pub hang_timeout_s: f64,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            hang_timeout_s: 0.0,
        }
    }
}

impl WatchdogConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.hang_timeout_s >= 0.0 && self.hang_timeout_s.is_finite()) {
            return Err(ConfigError::invalid(
                "watchdog.hang_timeout_s",
                self.hang_timeout_s,
                "0 (automatic) or a number of seconds",
            ));
        }
        Ok(())
    }
}
