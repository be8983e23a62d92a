//! Fault injection (`[faults]`), for testing recovery: one device's step fails, panics
//! or hangs, once per run (a marker in the run dir remembers that it fired, so the
//! restarted run does not fail again).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::{FaultKind, FaultsConfig};

pub struct Faults {
    /// (device position, step, kind), until it fires.
    plan: Option<(usize, u64, FaultKind)>,
    marker: PathBuf,
}

impl Faults {
    /// `first`: position of this process's first device among the run's (its rank in a
    /// multi-process run, whose `faults.device` counts ranks).
    pub fn new(cfg: &FaultsConfig, run_dir: &Path, first: usize) -> Self {
        let marker = run_dir.join("faults-fired");
        let plan = cfg
            .device
            .checked_sub(first)
            .filter(|_| cfg.inject != FaultKind::None && !marker.exists())
            .map(|device| (device, cfg.step, cfg.inject));
        Faults { plan, marker }
    }

    /// The fault for optimizer step `step` as (position among the run's devices, kind),
    /// if it is due on one of this process's `devices`.
    pub fn take(&mut self, step: u64, devices: usize, first: usize) -> Option<(usize, FaultKind)> {
        match self.plan {
            Some((device, at, kind)) if at == step && device < devices => {
                self.plan = None;
                let _ = std::fs::write(
                    &self.marker,
                    format!("{kind:?} on device {device} at step {step}\n"),
                );
                Some((first + device, kind))
            }
            _ => None,
        }
    }
}

/// Does what an injected fault of `kind` stands for, on the calling thread.
pub fn act_out(kind: FaultKind) -> Result<(), String> {
    match kind {
        FaultKind::None => Ok(()),
        FaultKind::Error => Err("injected fault (faults.inject = \"error\")".into()),
        FaultKind::Panic => panic!("injected fault (faults.inject = \"panic\")"),
        FaultKind::Hang => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
    }
}
