//! Finding out, without ever panicking, whether a CUDA driver and GPUs are there.
//!
//! cubecl panics on a background thread when the driver is missing or an ordinal is
//! invalid (and `Cuda::device_count()` initialises GPU 0 to count), so kiln asks the
//! driver itself first: cudarc's `is_culib_present` before `cuInit`, then only
//! attribute queries that create no context.

use serde::Serialize;

/// One GPU as the CUDA driver numbers it: after `CUDA_VISIBLE_DEVICES` is applied.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    /// Logical index, what `CudaDevice::new(i)` takes.
    pub ordinal: usize,
    pub name: String,
    pub uuid: String,
    pub pci_bus_id: String,
    pub total_mib: u64,
    /// Compute capability, e.g. (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// What NVML reports for the same GPU (matched by PCI bus id), when NVML is available.
    pub physical: Option<super::nvml::PhysicalGpu>,
}

/// What the probe found.
#[derive(Debug, Clone, PartialEq)]
pub enum Probe {
    /// The binary was built without the `cuda` feature.
    #[cfg_attr(feature = "cuda", allow(dead_code))]
    NotBuilt,
    /// No usable driver: the library is missing or `cuInit` failed (message says which).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    NoDriver(String),
    /// The driver answered; the list may be empty (e.g. `CUDA_VISIBLE_DEVICES=""`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Gpus(Vec<GpuInfo>),
}

#[cfg(feature = "cuda")]
pub fn probe() -> Probe {
    use cudarc::driver::{result, sys};

    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    if !unsafe { sys::is_culib_present() } {
        return Probe::NoDriver("the CUDA driver library (libcuda.so) was not found".into());
    }
    if let Err(e) = result::init() {
        // What the driver answers when CUDA_VISIBLE_DEVICES leaves no GPU visible: the
        // driver works, it shows this process nothing (the plan says why).
        if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE {
            return Probe::Gpus(Vec::new());
        }
        return Probe::NoDriver(format!("cuInit failed: {e}"));
    }
    let count = match result::device::get_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => return Probe::NoDriver(format!("cuDeviceGetCount failed: {e}")),
    };
    let mut gpus = Vec::with_capacity(count);
    for ordinal in 0..count {
        let Ok(dev) = result::device::get(ordinal as i32) else {
            continue;
        };
        let attr = |a: sys::CUdevice_attribute| {
            // SAFETY: `dev` came from cuDeviceGet; attribute queries need no context.
            unsafe { result::device::get_attribute(dev, a) }.unwrap_or(-1)
        };
        // NVML's spelling, so the two can be matched.
        let pci_bus_id = format!(
            "{:08x}:{:02x}:{:02x}.0",
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
        );
        let compute_capability = (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        // SAFETY: as above.
        let total = unsafe { result::device::total_mem(dev) }.unwrap_or(0);
        gpus.push(GpuInfo {
            ordinal,
            name: result::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into()),
            uuid: result::device::get_uuid(dev)
                .map(|u| format_uuid(&u.bytes))
                .unwrap_or_default(),
            pci_bus_id,
            total_mib: (total / (1024 * 1024)) as u64,
            compute_capability,
            physical: None,
        });
    }
    Probe::Gpus(gpus)
}

/// Device memory in use on GPU `ordinal`, by every process, in MiB (what nvidia-smi
/// shows). cubecl keeps the memory it reserved, so at the end of a run this is close
/// to the peak. Uses the primary context cubecl also uses; creates none.
#[cfg(feature = "cuda")]
pub fn memory_in_use_mib(ordinal: usize) -> Option<u64> {
    use cudarc::driver::result;
    let dev = result::device::get(ordinal as i32).ok()?;
    // SAFETY: retain/release are paired; the context is the device's primary one.
    unsafe {
        let ctx = result::primary_ctx::retain(dev).ok()?;
        result::ctx::set_current(ctx).ok()?;
        let info = result::mem_get_info().ok();
        let _ = result::primary_ctx::release(dev);
        info.map(|(free, total)| ((total - free) / (1024 * 1024)) as u64)
    }
}

#[cfg(not(feature = "cuda"))]
pub fn memory_in_use_mib(_ordinal: usize) -> Option<u64> {
    None
}

#[cfg(not(feature = "cuda"))]
pub fn probe() -> Probe {
    Probe::NotBuilt
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi and `CUDA_VISIBLE_DEVICES` write it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn format_uuid(bytes: &[std::ffi::c_char; 16]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex[0..4].concat(),
        hex[4..6].concat(),
        hex[6..8].concat(),
        hex[8..10].concat(),
        hex[10..16].concat()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_like_nvidia_smi() {
        let bytes: [std::ffi::c_char; 16] =
            std::array::from_fn(|i| (i * 17) as u8 as std::ffi::c_char);
        assert_eq!(
            format_uuid(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }
}
