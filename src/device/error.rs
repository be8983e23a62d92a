//! Everything that can be wrong with the devices a run asks for, worded for the user.

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("multi-process run: {0}; `kiln launch` and `srun` set these for each process")]
    World(#[from] super::world::WorldError),
    #[error("devices.backend = \"cuda\" but no GPU can be used: {0}")]
    CudaUnavailable(String),
    #[error(
        "devices.require_gpu = true but no GPU can be used: {0}; set devices.require_gpu = false to train on the CPU"
    )]
    GpuRequired(String),
    #[error(
        "devices.backend = \"cuda\" but this kiln was built without CUDA; rebuild with `cargo build --release` (the `cuda` feature is on by default)"
    )]
    NotBuilt,
    #[error("devices.use names cuda:{id}, which is not visible; visible: {visible}{hint}")]
    NotVisible {
        id: usize,
        visible: String,
        hint: String,
    },
    #[error("devices.use names cuda:{id} more than once")]
    Duplicate { id: usize },
    #[error("devices.min_free_mib = {need_mib} MiB is not available: {gpus}")]
    NotEnoughMemory { need_mib: u64, gpus: String },
    #[error(
        "devices.use = \"auto\" needs NVML to read free memory, and NVML is not available; name the GPUs in devices.use"
    )]
    AutoNeedsNvml,
    #[error("devices.main = {main} but only {count} GPU(s) are used; it is a position in the used GPUs, 0 to {}", count - 1)]
    MainOutOfRange { main: usize, count: usize },
    #[error(
        "{name}={value:?} is set, but CUDA reads CUDA_VISIBLE_DEVICES, which is not set, so every GPU would be used; rename it to CUDA_VISIBLE_DEVICES (or unset it)"
    )]
    Typo { name: String, value: String },
    #[error(
        "devices.visible = {config:?} but CUDA_VISIBLE_DEVICES={env:?} is already set in the environment; remove one of them"
    )]
    VisibleConflict { config: String, env: String },
    #[error(
        "devices.visible = {value:?}: {entry:?} is not a GPU index, a GPU-… UUID or a MIG-… instance; expected e.g. \"1,3\""
    )]
    BadVisible { value: String, entry: String },
    #[error(
        "CUDA_VISIBLE_DEVICES is set but is not text ({lossy:?}); set it to GPU indices or UUIDs such as \"0,1\", or unset it"
    )]
    VisibleNotText { lossy: String },
    #[error(
        "{source_name}={value:?} names {entry} twice; the CUDA driver refuses such a list (every GPU call fails with \"invalid device ordinal\"): list each GPU once"
    )]
    VisibleRepeats {
        source_name: &'static str,
        value: String,
        entry: String,
    },
    #[error("cuda:{ordinal} ({name}) cannot be used: {reason}")]
    Unusable {
        ordinal: usize,
        name: String,
        reason: String,
    },
}

impl DeviceError {
    /// The machine, not the request: no usable GPU where one was required. May be
    /// different elsewhere, but not on a restart here.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            DeviceError::GpuRequired(_)
                | DeviceError::CudaUnavailable(_)
                | DeviceError::NotEnoughMemory { .. }
                | DeviceError::Unusable { .. }
        )
    }
}
