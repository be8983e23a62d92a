//! What NVML says about every physical GPU: identity, free memory, utilisation, the
//! processes holding memory, and how GPUs are connected. NVML numbers GPUs physically
//! and ignores `CUDA_VISIBLE_DEVICES`; kiln matches it to CUDA by PCI bus id, never by
//! index. The library is loaded at run time; without it kiln still works, with less to show.

use serde::Serialize;

/// One physical GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhysicalGpu {
    /// NVML (physical) index.
    pub index: usize,
    pub uuid: String,
    pub name: String,
    /// `dddddddd:bb:dd.f`, lower case.
    pub pci_bus_id: String,
    pub total_mib: u64,
    pub free_mib: u64,
    pub utilization_pct: Option<u32>,
    /// `Default`, `ExclusiveProcess`, `Prohibited`, ...
    pub compute_mode: String,
    /// Processes with memory on this GPU: (pid, name, MiB).
    pub processes: Vec<(u32, String, u64)>,
}

/// How two GPUs talk, best first.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Link {
    /// Across CPU sockets.
    System,
    /// Same NUMA node, different host bridges.
    Node,
    /// Same host bridge.
    HostBridge,
    /// PCIe switches, no host bridge.
    PcieSwitches,
    /// One PCIe switch.
    PcieSwitch,
    /// NVLink, with this many links.
    NvLinks(u32),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NvmlSnapshot {
    pub gpus: Vec<PhysicalGpu>,
    /// `(a, b, link)` for every pair `a < b` of physical indices NVML could relate.
    pub links: Vec<(usize, usize, Link)>,
}

impl NvmlSnapshot {
    pub fn link(&self, a: usize, b: usize) -> Option<Link> {
        let (a, b) = (a.min(b), a.max(b));
        self.links
            .iter()
            .find(|(x, y, _)| (*x, *y) == (a, b))
            .map(|l| l.2)
    }

    pub fn by_bus_id(&self, bus_id: &str) -> Option<&PhysicalGpu> {
        self.gpus
            .iter()
            .find(|g| g.pci_bus_id.eq_ignore_ascii_case(bus_id))
    }
}

/// Memory and load of one GPU at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuUsage {
    /// Memory in use on the GPU, by every process.
    pub used_mib: u64,
    pub total_mib: u64,
    /// Share of the last sample period in which a kernel ran.
    pub utilization_pct: Option<u32>,
}

/// Samples the GPUs of a plan through NVML, matched by PCI bus id; `None` for a GPU
/// NVML cannot read (or every GPU, without NVML).
pub struct UsageMonitor {
    #[cfg(feature = "cuda")]
    nvml: Option<nvml_wrapper::Nvml>,
    bus_ids: Vec<String>,
}

impl UsageMonitor {
    pub fn new(bus_ids: Vec<String>) -> Self {
        UsageMonitor {
            #[cfg(feature = "cuda")]
            nvml: nvml_wrapper::Nvml::init().ok(),
            bus_ids,
        }
    }

    #[cfg(feature = "cuda")]
    pub fn sample(&self) -> Vec<Option<GpuUsage>> {
        self.bus_ids
            .iter()
            .map(|id| {
                let dev = self.nvml.as_ref()?.device_by_pci_bus_id(id.as_str()).ok()?;
                let mem = dev.memory_info().ok()?;
                Some(GpuUsage {
                    used_mib: mem.used / (1024 * 1024),
                    total_mib: mem.total / (1024 * 1024),
                    utilization_pct: dev.utilization_rates().ok().map(|u| u.gpu),
                })
            })
            .collect()
    }

    #[cfg(not(feature = "cuda"))]
    pub fn sample(&self) -> Vec<Option<GpuUsage>> {
        vec![None; self.bus_ids.len()]
    }
}

/// `NVML_NVLINK_MAX_LINKS` in nvml.h.
#[cfg(feature = "cuda")]
const NVLINK_MAX_LINKS: u32 = 18;

/// Reads NVML; `Err` says why it could not (no library, no driver, no permission).
#[cfg(feature = "cuda")]
pub fn snapshot() -> Result<NvmlSnapshot, String> {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::enum_wrappers::device::TopologyLevel;
    use nvml_wrapper::enums::device::UsedGpuMemory;

    let nvml = Nvml::init().map_err(|e| format!("NVML is not available: {e}"))?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML cannot count GPUs: {e}"))?;
    let mut snap = NvmlSnapshot::default();
    let mut opened = Vec::new();
    for index in 0..count {
        let dev = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                // A GPU NVML cannot open still counts; show it with the reason.
                snap.gpus.push(PhysicalGpu {
                    index: index as usize,
                    uuid: String::new(),
                    name: format!("(cannot open: {e})"),
                    pci_bus_id: String::new(),
                    total_mib: 0,
                    free_mib: 0,
                    utilization_pct: None,
                    compute_mode: "unknown".into(),
                    processes: Vec::new(),
                });
                continue;
            }
        };
        let mem = dev.memory_info().ok();
        let processes = dev
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let name = std::fs::read_to_string(format!("/proc/{}/comm", p.pid))
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| "?".into());
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b / (1024 * 1024),
                    UsedGpuMemory::Unavailable => 0,
                };
                (p.pid, name, used)
            })
            .collect();
        snap.gpus.push(PhysicalGpu {
            index: index as usize,
            uuid: dev.uuid().unwrap_or_default(),
            name: dev.name().unwrap_or_else(|_| "unknown GPU".into()),
            pci_bus_id: dev
                .pci_info()
                .map(|p| p.bus_id.to_lowercase())
                .unwrap_or_default(),
            total_mib: mem.as_ref().map(|m| m.total / (1024 * 1024)).unwrap_or(0),
            free_mib: mem.as_ref().map(|m| m.free / (1024 * 1024)).unwrap_or(0),
            utilization_pct: dev.utilization_rates().ok().map(|u| u.gpu),
            compute_mode: dev
                .compute_mode()
                .map(|m| format!("{m:?}"))
                .unwrap_or_else(|_| "unknown".into()),
            processes,
        });
        opened.push(index as usize);
    }
    for (i, &a) in opened.iter().enumerate() {
        for &b in &opened[i + 1..] {
            let (Ok(da), Ok(db)) = (
                nvml.device_by_index(a as u32),
                nvml.device_by_index(b as u32),
            ) else {
                continue;
            };
            let bus_b = snap.gpus[b].pci_bus_id.clone();
            let nvlinks = (0..NVLINK_MAX_LINKS)
                .filter(|&l| {
                    let link = da.link_wrapper_for(l);
                    link.is_active().unwrap_or(false)
                        && link
                            .remote_pci_info()
                            .is_ok_and(|p| p.bus_id.eq_ignore_ascii_case(&bus_b))
                })
                .count() as u32;
            let link = if nvlinks > 0 {
                Some(Link::NvLinks(nvlinks))
            } else {
                da.topology_common_ancestor(db).ok().map(|t| match t {
                    TopologyLevel::Internal | TopologyLevel::Single => Link::PcieSwitch,
                    TopologyLevel::Multiple => Link::PcieSwitches,
                    TopologyLevel::HostBridge => Link::HostBridge,
                    TopologyLevel::Node => Link::Node,
                    TopologyLevel::System => Link::System,
                })
            };
            if let Some(link) = link {
                snap.links.push((a, b, link));
            }
        }
    }
    Ok(snap)
}

#[cfg(not(feature = "cuda"))]
pub fn snapshot() -> Result<NvmlSnapshot, String> {
    Err("this kiln was built without the `cuda` feature".into())
}
