//! `failure.json` in a run dir: what a training process writes when a device fails or
//! hangs, and `devices.json`: the GPUs it used. The supervisor reads both to decide how
//! to restart. Plain data, no Burn.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub const FAILURE_FILE: &str = "failure.json";
pub const DEVICES_FILE: &str = "devices.json";

/// Why a training process gave up on a device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// Optimizer step during which it happened.
    pub step: u64,
    /// Position of the device among those used, when known.
    pub device_position: Option<usize>,
    /// e.g. `cuda:1 NVIDIA H200`.
    pub device: String,
    /// `error`, `hang`, or `unavailable` (no usable GPU where one was required).
    pub kind: String,
    pub message: String,
    /// Whether restarting cannot help: the same attempt would fail the same way.
    #[serde(default)]
    pub permanent: bool,
}

impl Failure {
    /// A training process that could not start on the devices it was asked for (no
    /// usable GPU with `devices.backend = "cuda"` or `devices.require_gpu`): restarting
    /// it on the same machine cannot help.
    pub fn unavailable(message: String) -> Self {
        Failure {
            step: 0,
            device_position: None,
            device: "no usable GPU".into(),
            kind: "unavailable".into(),
            message,
            permanent: true,
        }
    }
}

/// One device a training process used, in order (the main device first).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsedDevice {
    pub name: String,
    /// `GPU-…`; empty for the CPU. The supervisor names surviving GPUs by UUID, which
    /// does not change when `CUDA_VISIBLE_DEVICES` renumbers them.
    pub uuid: String,
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(
        &tmp,
        serde_json::to_string_pretty(value).expect("plain data serializes"),
    )?;
    std::fs::rename(&tmp, path)
}

pub fn write_failure(run_dir: &Path, failure: &Failure) -> std::io::Result<()> {
    write_json(&run_dir.join(FAILURE_FILE), failure)
}

/// Reads and removes the failure record (each one is acted on once).
pub fn take_failure(run_dir: &Path) -> Option<Failure> {
    let path = run_dir.join(FAILURE_FILE);
    let failure = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok();
    let _ = std::fs::remove_file(&path);
    failure
}

pub fn write_devices(run_dir: &Path, devices: &[UsedDevice]) -> std::io::Result<()> {
    write_json(&run_dir.join(DEVICES_FILE), &devices)
}

/// `ranks.json`: each process of a multi-process attempt on this machine, for the user
/// who wants to find one (and for tests that kill one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankProcess {
    pub rank: usize,
    pub pid: u32,
    pub device: String,
}

pub const RANKS_FILE: &str = "ranks.json";

pub fn write_ranks(run_dir: &Path, ranks: &[RankProcess]) -> std::io::Result<()> {
    write_json(&run_dir.join(RANKS_FILE), &ranks)
}

pub fn read_devices(run_dir: &Path) -> Vec<UsedDevice> {
    std::fs::read_to_string(run_dir.join(DEVICES_FILE))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}
