//! Turning `[devices]` plus what the probe found into a [`DevicePlan`]: which backend
//! and which GPU, or the CPU and why. Pure: takes the probe result as a value.

use std::path::PathBuf;

use crate::config::{BackendChoice, DevicesConfig};

use super::probe::{GpuInfo, Probe};

/// Where training runs, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum DevicePlan {
    /// Train on these GPUs (logical CUDA indices); the first one is the main device.
    Cuda { gpus: Vec<GpuInfo> },
    /// Train on the CPU backend; `reason` is shown to the user.
    Cpu { reason: String },
}

impl DevicePlan {
    /// One line for the log: what runs where.
    pub fn describe(&self) -> String {
        match self {
            DevicePlan::Cuda { gpus } => gpus
                .iter()
                .map(|g| {
                    format!(
                        "cuda:{} {} ({} MiB, {})",
                        g.ordinal, g.name, g.total_mib, g.pci_bus_id
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            DevicePlan::Cpu { .. } => "cpu (Burn Flex backend)".to_string(),
        }
    }

    pub fn device_names(&self) -> Vec<String> {
        match self {
            DevicePlan::Cuda { gpus } => gpus
                .iter()
                .map(|g| format!("cuda:{} {}", g.ordinal, g.name))
                .collect(),
            DevicePlan::Cpu { .. } => vec!["cpu".to_string()],
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("devices.backend = \"cuda\" but no GPU can be used: {0}")]
    CudaUnavailable(String),
    #[error(
        "devices.require_gpu = true but no GPU can be used: {0}; set devices.require_gpu = false to train on the CPU"
    )]
    GpuRequired(String),
    #[error("devices.main = {main} is not a visible GPU: {visible}")]
    BadOrdinal { main: usize, visible: String },
    #[error(
        "devices.backend = \"cuda\" but this kiln was built without CUDA; rebuild with `cargo build --release` (the `cuda` feature is on by default)"
    )]
    NotBuilt,
}

/// Resolves the plan. `visible_env` is the raw `CUDA_VISIBLE_DEVICES`, for messages only.
pub fn plan(
    cfg: &DevicesConfig,
    probe: &Probe,
    visible_env: Option<&str>,
) -> Result<DevicePlan, DeviceError> {
    let why_none = match probe {
        Probe::NotBuilt => "this kiln was built without the `cuda` feature".to_string(),
        Probe::NoDriver(why) => why.clone(),
        Probe::Gpus(g) if g.is_empty() => match visible_env {
            Some(v) => format!("the driver sees no GPU (CUDA_VISIBLE_DEVICES={v:?})"),
            None => "the driver sees no GPU".to_string(),
        },
        Probe::Gpus(_) => String::new(),
    };
    match (cfg.backend, probe) {
        (BackendChoice::Cpu, _) => Ok(DevicePlan::Cpu {
            reason: "devices.backend = \"cpu\"".into(),
        }),
        (BackendChoice::Cuda, Probe::NotBuilt) => Err(DeviceError::NotBuilt),
        (_, Probe::Gpus(gpus)) if !gpus.is_empty() => {
            let Some(main) = gpus.iter().find(|g| g.ordinal == cfg.main) else {
                let visible = gpus
                    .iter()
                    .map(|g| format!("cuda:{} ({})", g.ordinal, g.name))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(DeviceError::BadOrdinal {
                    main: cfg.main,
                    visible,
                });
            };
            Ok(DevicePlan::Cuda {
                gpus: vec![main.clone()],
            })
        }
        (BackendChoice::Cuda, _) => Err(DeviceError::CudaUnavailable(why_none)),
        (BackendChoice::Auto, _) if cfg.require_gpu => Err(DeviceError::GpuRequired(why_none)),
        (BackendChoice::Auto, _) => Ok(DevicePlan::Cpu { reason: why_none }),
    }
}

/// The directory that holds compiled kernels and autotune results across runs.
/// `configured` is `devices.cache_dir`; then `$KILN_CACHE_DIR`, `$XDG_CACHE_HOME/kiln`,
/// `~/.cache/kiln`, and last `./.kiln-cache`.
pub fn kernel_cache_dir(configured: &str) -> PathBuf {
    if !configured.is_empty() {
        return PathBuf::from(configured);
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(dir) = env("KILN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = env("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("kiln");
    }
    if let Some(home) = env("HOME") {
        return PathBuf::from(home).join(".cache").join("kiln");
    }
    PathBuf::from(".kiln-cache")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordinal: usize) -> GpuInfo {
        GpuInfo {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: format!("GPU-{ordinal}"),
            pci_bus_id: format!("00000000:0{ordinal}:00.0"),
            total_mib: 143_771,
            compute_capability: (9, 0),
        }
    }

    fn cfg(backend: BackendChoice, require_gpu: bool, main: usize) -> DevicesConfig {
        DevicesConfig {
            backend,
            require_gpu,
            main,
            ..DevicesConfig::default()
        }
    }

    #[test]
    fn auto_without_driver_falls_back_to_cpu_and_says_why() {
        let p = plan(
            &cfg(BackendChoice::Auto, false, 0),
            &Probe::NoDriver("no libcuda".into()),
            None,
        )
        .unwrap();
        assert_eq!(
            p,
            DevicePlan::Cpu {
                reason: "no libcuda".into()
            }
        );
    }

    #[test]
    fn empty_visible_set_is_named_in_the_reason() {
        let p = plan(
            &cfg(BackendChoice::Auto, false, 0),
            &Probe::Gpus(vec![]),
            Some(""),
        )
        .unwrap();
        let DevicePlan::Cpu { reason } = p else {
            panic!("expected cpu")
        };
        assert!(reason.contains("CUDA_VISIBLE_DEVICES=\"\""), "{reason}");
    }

    #[test]
    fn require_gpu_turns_the_fallback_into_an_error() {
        let err = plan(
            &cfg(BackendChoice::Auto, true, 0),
            &Probe::Gpus(vec![]),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, DeviceError::GpuRequired(_)));
        let err = plan(
            &cfg(BackendChoice::Cuda, false, 0),
            &Probe::NoDriver("x".into()),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, DeviceError::CudaUnavailable(_)));
    }

    #[test]
    fn main_picks_the_gpu_and_a_missing_one_lists_what_is_visible() {
        let probe = Probe::Gpus(vec![gpu(0), gpu(1)]);
        let p = plan(&cfg(BackendChoice::Auto, false, 1), &probe, None).unwrap();
        assert_eq!(p, DevicePlan::Cuda { gpus: vec![gpu(1)] });
        let msg = plan(&cfg(BackendChoice::Auto, false, 2), &probe, None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("devices.main = 2"), "{msg}");
        assert!(msg.contains("cuda:0") && msg.contains("cuda:1"), "{msg}");
    }

    #[test]
    fn cpu_choice_ignores_gpus() {
        let p = plan(
            &cfg(BackendChoice::Cpu, true, 0),
            &Probe::Gpus(vec![gpu(0)]),
            None,
        )
        .unwrap();
        assert!(matches!(p, DevicePlan::Cpu { .. }));
    }
}
