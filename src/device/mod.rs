//! The device layer: what `CUDA_VISIBLE_DEVICES` and the config ask for, what the CUDA
//! driver and NVML report, and the resolved [`DevicePlan`]. No Burn here; the plan is
//! turned into Burn device handles in `train::backend`. This layer and the CLI are the
//! only places that read the environment.

mod env;
mod error;
mod nvml;
mod plan;
mod probe;
mod select;
mod usage;
mod visible;
pub mod world;

pub use env::DeviceEnv;
pub use error::DeviceError;
pub use nvml::UsageMonitor;
pub use plan::{DevicePlan, Inventory, kernel_cache_dir, plan};
pub use probe::{GpuInfo, Probe, memory_in_use_mib};
pub use usage::UsageSampler;
pub use world::World;

use crate::config::DevicesConfig;

/// Applies `devices.visible` to this process's environment, before any CUDA call, and
/// returns the environment as CUDA will read it.
pub fn apply_visible(cfg: &DevicesConfig, env: DeviceEnv) -> Result<DeviceEnv, DeviceError> {
    if let Some(lossy) = &env.unreadable {
        return Err(DeviceError::VisibleNotText {
            lossy: lossy.clone(),
        });
    }
    for (source_name, value) in [
        ("CUDA_VISIBLE_DEVICES", env.visible.as_deref().unwrap_or("")),
        ("devices.visible", cfg.visible.as_str()),
    ] {
        if let Some(entry) = visible::repeated(value) {
            return Err(DeviceError::VisibleRepeats {
                source_name,
                value: value.to_string(),
                entry,
            });
        }
    }
    let wanted = cfg.visible.trim();
    if wanted.is_empty() {
        return Ok(env);
    }
    if let Some(entry) = wanted
        .split(',')
        .map(str::trim)
        .find(|t| visible::parse(t).is_none())
    {
        return Err(DeviceError::BadVisible {
            value: cfg.visible.clone(),
            entry: entry.to_string(),
        });
    }
    match &env.visible {
        Some(current) if current.trim() != wanted => Err(DeviceError::VisibleConflict {
            config: cfg.visible.clone(),
            env: current.clone(),
        }),
        Some(_) => Ok(env),
        None => {
            // SAFETY: called from the CLI before any thread that reads the environment
            // (loader, signal handler, CUDA) has been started.
            unsafe { std::env::set_var(env::VISIBLE, wanted) };
            Ok(DeviceEnv {
                visible: Some(wanted.to_string()),
                ..env
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_visible_conflicting_with_the_environment_is_an_error_showing_both() {
        let cfg = DevicesConfig {
            visible: "1".into(),
            ..DevicesConfig::default()
        };
        let env = DeviceEnv {
            visible: Some("0,1".into()),
            ..DeviceEnv::default()
        };
        let e = apply_visible(&cfg, env.clone()).unwrap_err().to_string();
        assert!(
            e.contains("devices.visible = \"1\"") && e.contains("CUDA_VISIBLE_DEVICES=\"0,1\""),
            "{e}"
        );
        let same = DevicesConfig {
            visible: "0,1".into(),
            ..DevicesConfig::default()
        };
        assert_eq!(
            apply_visible(&same, env).unwrap().visible.as_deref(),
            Some("0,1")
        );
        let bad = DevicesConfig {
            visible: "1,x".into(),
            ..DevicesConfig::default()
        };
        let e = apply_visible(&bad, DeviceEnv::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"x\" is not a GPU index"), "{e}");
    }
}
