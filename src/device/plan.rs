//! Turning `[devices]`, the environment and what the driver and NVML report into a
//! [`DevicePlan`]: which GPUs, which is the main one, and why; or the CPU and why.
//! Pure: everything it looks at is passed in as values, so tests use fakes.

use std::path::PathBuf;

use crate::config::{BackendChoice, DevicesConfig};

use super::env::DeviceEnv;
use super::error::DeviceError;
use super::nvml::NvmlSnapshot;
use super::probe::{GpuInfo, Probe};
use super::select::choose;
use super::visible::{Physical, resolve};

/// Where training runs, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum DevicePlan {
    /// These GPUs, the main device first.
    Cuda { gpus: Vec<GpuInfo>, reason: String },
    /// The CPU backend; `reason` is shown to the user.
    Cpu { reason: String },
}

impl DevicePlan {
    /// One line for the log: what runs where.
    pub fn describe(&self) -> String {
        match self {
            DevicePlan::Cuda { gpus, .. } => gpus
                .iter()
                .map(|g| {
                    let physical = g
                        .physical
                        .as_ref()
                        .map(|p| format!("physical GPU {}, ", p.index))
                        .unwrap_or_default();
                    format!(
                        "cuda:{} {} ({physical}{}, {} MiB)",
                        g.ordinal, g.name, g.pci_bus_id, g.total_mib
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
            DevicePlan::Cpu { .. } => "cpu (Burn Flex backend)".to_string(),
        }
    }

    pub fn device_names(&self) -> Vec<String> {
        match self {
            DevicePlan::Cuda { gpus, .. } => gpus
                .iter()
                .map(|g| format!("cuda:{} {}", g.ordinal, g.name))
                .collect(),
            DevicePlan::Cpu { .. } => vec!["cpu".to_string()],
        }
    }
}

/// Everything the planner knows about the machine.
#[derive(Debug, Clone)]
pub struct Inventory {
    pub probe: Probe,
    pub nvml: Result<NvmlSnapshot, String>,
}

impl Inventory {
    /// Asks the driver and NVML (CUDA builds); links each CUDA device to its NVML entry by PCI bus id.
    pub fn read() -> Self {
        Self::assemble(super::probe::probe(), super::nvml::snapshot())
    }

    pub fn assemble(mut probe: Probe, nvml: Result<NvmlSnapshot, String>) -> Self {
        if let (Probe::Gpus(gpus), Ok(snap)) = (&mut probe, &nvml) {
            for g in gpus.iter_mut() {
                g.physical = snap.by_bus_id(&g.pci_bus_id).cloned();
            }
        }
        Inventory { probe, nvml }
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        match &self.probe {
            Probe::Gpus(g) => g,
            _ => &[],
        }
    }

    /// Why `CUDA_VISIBLE_DEVICES` shows fewer GPUs than it seems to ask for.
    pub fn visible_warnings(&self, env: &DeviceEnv) -> Vec<String> {
        match (&env.visible, &self.nvml) {
            (Some(raw), Ok(snap)) => {
                let physical: Vec<Physical> = snap
                    .gpus
                    .iter()
                    .map(|g| Physical {
                        index: g.index,
                        uuid: g.uuid.clone(),
                    })
                    .collect();
                resolve(raw, &physical).warnings
            }
            _ => Vec::new(),
        }
    }
}

/// The plan, plus warnings worth showing.
pub fn plan(
    cfg: &DevicesConfig,
    env: &DeviceEnv,
    inv: &Inventory,
) -> Result<(DevicePlan, Vec<String>), DeviceError> {
    let mut notes = inv.visible_warnings(env);
    if let Some((name, value)) = env.typos.first() {
        if env.visible.is_none() && cfg.backend != BackendChoice::Cpu {
            return Err(DeviceError::Typo {
                name: name.clone(),
                value: value.clone(),
            });
        }
        notes.push(format!(
            "{name}={value:?} is set but has no effect; CUDA reads CUDA_VISIBLE_DEVICES"
        ));
    }
    let why_none = match &inv.probe {
        Probe::NotBuilt => "this kiln was built without the `cuda` feature".to_string(),
        Probe::NoDriver(why) => why.clone(),
        Probe::Gpus(g) if g.is_empty() => match &env.visible {
            Some(v) if v.trim().is_empty() => {
                format!("CUDA_VISIBLE_DEVICES={v:?} hides every GPU from this process")
            }
            Some(v) => format!("no GPU is visible under CUDA_VISIBLE_DEVICES={v:?}"),
            None => "the driver sees no GPU".to_string(),
        },
        Probe::Gpus(_) => String::new(),
    };
    let gpus = inv.gpus();
    let plan = match (cfg.backend, &inv.probe) {
        (BackendChoice::Cpu, _) => DevicePlan::Cpu {
            reason: "devices.backend = \"cpu\"".into(),
        },
        (BackendChoice::Cuda, Probe::NotBuilt) => return Err(DeviceError::NotBuilt),
        (_, Probe::Gpus(_)) if !gpus.is_empty() => {
            let choice = choose(
                &cfg.select,
                cfg.count,
                cfg.min_free_mib,
                gpus,
                inv.nvml.as_ref().ok(),
                env.visible.as_deref(),
            )?;
            if cfg.main >= choice.ordinals.len() {
                return Err(DeviceError::MainOutOfRange {
                    main: cfg.main,
                    count: choice.ordinals.len(),
                });
            }
            let mut chosen: Vec<GpuInfo> = choice
                .ordinals
                .iter()
                .map(|o| {
                    gpus.iter()
                        .find(|g| g.ordinal == *o)
                        .expect("choose returns visible GPUs")
                        .clone()
                })
                .collect();
            for g in &chosen {
                check_usable(g)?;
            }
            chosen.swap(0, cfg.main);
            DevicePlan::Cuda {
                gpus: chosen,
                reason: choice.reason,
            }
        }
        (BackendChoice::Cuda, _) => return Err(DeviceError::CudaUnavailable(why_none)),
        (BackendChoice::Auto, _) if cfg.require_gpu => {
            return Err(DeviceError::GpuRequired(why_none));
        }
        (BackendChoice::Auto, _) => DevicePlan::Cpu { reason: why_none },
    };
    Ok((plan, notes))
}

/// A GPU in a compute mode that refuses this process is named with the reason.
fn check_usable(g: &GpuInfo) -> Result<(), DeviceError> {
    let Some(p) = &g.physical else {
        return Ok(());
    };
    let reason = match p.compute_mode.as_str() {
        "Prohibited" => {
            Some("its compute mode is Prohibited (no CUDA contexts allowed)".to_string())
        }
        "ExclusiveProcess" if !p.processes.is_empty() => Some(format!(
            "it is in exclusive-process mode and held by {}",
            p.processes
                .iter()
                .map(|(pid, name, _)| format!("{name} (pid {pid})"))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        _ => None,
    };
    match reason {
        Some(reason) => Err(DeviceError::Unusable {
            ordinal: g.ordinal,
            name: g.name.clone(),
            reason,
        }),
        None => Ok(()),
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
    use crate::config::Selection;
    use crate::device::nvml::PhysicalGpu;

    fn physical(index: usize) -> PhysicalGpu {
        PhysicalGpu {
            index,
            uuid: format!("GPU-{index}{index}{index}{index}-aaaa"),
            name: "NVIDIA H200".into(),
            pci_bus_id: format!("00000000:0{index}:00.0"),
            total_mib: 143_771,
            free_mib: 143_000,
            utilization_pct: Some(0),
            compute_mode: "Default".into(),
            processes: vec![],
        }
    }

    /// A two-GPU machine seen through `CUDA_VISIBLE_DEVICES = visible` (physical indices).
    fn machine(visible: &[usize]) -> Inventory {
        let snap = NvmlSnapshot {
            gpus: vec![physical(0), physical(1)],
            links: vec![],
        };
        let gpus = visible
            .iter()
            .enumerate()
            .map(|(ordinal, &p)| GpuInfo {
                ordinal,
                name: "NVIDIA H200".into(),
                uuid: physical(p).uuid,
                pci_bus_id: physical(p).pci_bus_id,
                total_mib: 143_771,
                compute_capability: (9, 0),
                physical: None,
            })
            .collect();
        Inventory::assemble(Probe::Gpus(gpus), Ok(snap))
    }

    fn env(visible: Option<&str>, typos: &[(&str, &str)]) -> DeviceEnv {
        DeviceEnv {
            visible: visible.map(String::from),
            typos: typos
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            slurm: vec![],
            unreadable: None,
        }
    }

    fn cfg() -> DevicesConfig {
        DevicesConfig::default()
    }

    fn physical_of(plan: &DevicePlan) -> Vec<usize> {
        match plan {
            DevicePlan::Cuda { gpus, .. } => gpus
                .iter()
                .map(|g| g.physical.as_ref().unwrap().index)
                .collect(),
            DevicePlan::Cpu { .. } => vec![],
        }
    }

    #[test]
    fn cuda_devices_are_matched_to_nvml_by_bus_id_not_index() {
        // CUDA_VISIBLE_DEVICES=1,0: cuda:0 is physical 1.
        let (p, _) = plan(&cfg(), &env(Some("1,0"), &[]), &machine(&[1, 0])).unwrap();
        assert_eq!(physical_of(&p), vec![1, 0]);
        let mut c = cfg();
        c.select = Selection::List(vec![1]);
        let (p, _) = plan(&c, &env(Some("0,1"), &[]), &machine(&[0, 1])).unwrap();
        assert_eq!(physical_of(&p), vec![1]);
    }

    #[test]
    fn main_device_comes_first() {
        let mut c = cfg();
        c.main = 1;
        let (p, _) = plan(&c, &env(None, &[]), &machine(&[0, 1])).unwrap();
        assert_eq!(physical_of(&p), vec![1, 0]);
        c.select = Selection::List(vec![0]);
        assert!(matches!(
            plan(&c, &env(None, &[]), &machine(&[0, 1])),
            Err(DeviceError::MainOutOfRange { .. })
        ));
    }

    #[test]
    fn an_empty_visible_list_explains_the_cpu_fallback() {
        let (p, _) = plan(&cfg(), &env(Some(""), &[]), &machine(&[])).unwrap();
        let DevicePlan::Cpu { reason } = p else {
            panic!("expected the CPU")
        };
        assert_eq!(
            reason,
            "CUDA_VISIBLE_DEVICES=\"\" hides every GPU from this process"
        );
    }

    #[test]
    fn an_out_of_range_visible_entry_explains_the_cpu_fallback() {
        let (p, notes) = plan(&cfg(), &env(Some("5"), &[]), &machine(&[])).unwrap();
        let DevicePlan::Cpu { reason } = p else {
            panic!("expected the CPU")
        };
        assert!(reason.contains("CUDA_VISIBLE_DEVICES=\"5\""), "{reason}");
        assert!(
            notes[0].contains("GPU 5 does not exist (this machine has GPUs 0, 1)"),
            "{notes:?}"
        );
    }

    #[test]
    fn a_misspelt_variable_is_an_error_when_the_real_one_is_unset() {
        let e = plan(
            &cfg(),
            &env(None, &[("CUDA_VISBLE_DEVICES", "1")]),
            &machine(&[0, 1]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("CUDA_VISBLE_DEVICES=\"1\""), "{e}");
        let (_, notes) = plan(
            &cfg(),
            &env(Some("1"), &[("CUDA_VISBLE_DEVICES", "1")]),
            &machine(&[1]),
        )
        .unwrap();
        assert!(
            notes.iter().any(|n| n.contains("has no effect")),
            "{notes:?}"
        );
    }

    #[test]
    fn no_driver_falls_back_to_cpu_unless_a_gpu_is_required() {
        let inv = Inventory::assemble(Probe::NoDriver("no libcuda".into()), Err("no NVML".into()));
        let (p, _) = plan(&cfg(), &env(None, &[]), &inv).unwrap();
        assert_eq!(
            p,
            DevicePlan::Cpu {
                reason: "no libcuda".into()
            }
        );
        let mut c = cfg();
        c.require_gpu = true;
        assert!(matches!(
            plan(&c, &env(None, &[]), &inv),
            Err(DeviceError::GpuRequired(_))
        ));
        c.backend = BackendChoice::Cuda;
        assert!(matches!(
            plan(&c, &env(None, &[]), &inv),
            Err(DeviceError::CudaUnavailable(_))
        ));
        c.backend = BackendChoice::Cpu;
        assert!(matches!(
            plan(&c, &env(None, &[]), &inv).unwrap().0,
            DevicePlan::Cpu { .. }
        ));
    }

    #[test]
    fn exclusive_process_gpu_held_by_another_process_is_named() {
        let mut inv = machine(&[0]);
        if let Probe::Gpus(g) = &mut inv.probe {
            let p = g[0].physical.as_mut().unwrap();
            p.compute_mode = "ExclusiveProcess".into();
            p.processes = vec![(77, "trainer".into(), 1000)];
        }
        let e = plan(&cfg(), &env(None, &[]), &inv).unwrap_err().to_string();
        assert!(
            e.contains("exclusive-process mode and held by trainer (pid 77)"),
            "{e}"
        );
    }
}
