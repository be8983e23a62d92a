//! The device layer: probing the CUDA driver, reading the visible set, and resolving
//! `[devices]` into a [`DevicePlan`]. No Burn here; the plan is turned into Burn
//! device handles in `train::backend`.

mod plan;
mod probe;

pub use plan::{DeviceError, DevicePlan, kernel_cache_dir, plan};
pub use probe::{GpuInfo, Probe, memory_in_use_mib, probe};

/// `CUDA_VISIBLE_DEVICES` as set for this process, if it is.
pub fn visible_env() -> Option<String> {
    std::env::var("CUDA_VISIBLE_DEVICES").ok()
}
