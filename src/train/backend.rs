//! The only module that names concrete backends. Every command that does tensor work
//! goes through [`with_backend`], so the generic stack is instantiated once per
//! compiled backend: `Autodiff<Cuda>` and `Autodiff<Flex>` (the CPU).

use std::path::PathBuf;

use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};
use burn::tensor::backend::AutodiffBackend;

use crate::config::Autotune;
use crate::device::DevicePlan;

/// How cubecl compiles and tunes kernels; read once, before the first CUDA call.
#[derive(Debug, Clone)]
pub struct KernelSettings {
    /// Compiled kernels and autotune results, kept across runs.
    pub cache_dir: PathBuf,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub autotune: Autotune,
}

/// Work that runs on whichever backend the plan picks.
pub trait BackendJob {
    type Output;
    fn run<B: AutodiffBackend>(self, devices: Vec<B::Device>) -> Self::Output;
}

pub fn with_backend<J: BackendJob>(
    plan: &DevicePlan,
    kernels: &KernelSettings,
    job: J,
) -> J::Output {
    match plan {
        DevicePlan::Cuda { gpus, .. } => cuda::run(gpus, kernels, job),
        DevicePlan::Cpu { .. } => job.run::<Autodiff<Flex>>(vec![FlexDevice]),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Once;

    use burn::backend::Autodiff;
    use burn::backend::cuda::{Cuda, CudaDevice};
    use burn::cubecl::config::autotune::AutotuneLevel;
    use burn::cubecl::config::cache::CacheConfig;
    use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

    use super::{BackendJob, KernelSettings};
    use crate::config::Autotune;
    use crate::device::GpuInfo;

    pub fn run<J: BackendJob>(gpus: &[GpuInfo], kernels: &KernelSettings, job: J) -> J::Output {
        configure(kernels);
        job.run::<Autodiff<Cuda>>(gpus.iter().map(|g| CudaDevice::new(g.ordinal)).collect())
    }

    /// Points cubecl's compiled-kernel and autotune caches at `dir` before the first
    /// device call. (Compiled kernels are not cached at all by default, so every run
    /// would pay minutes of NVRTC compilation again.) A user's `cubecl.toml` and
    /// `CUBECL_*` variables still apply to everything else.
    fn configure(kernels: &KernelSettings) {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let dir = &kernels.cache_dir;
            let _ = std::fs::create_dir_all(dir);
            let mut cfg = CubeClRuntimeConfig::from_current_dir().override_from_env();
            cfg.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
            cfg.autotune.cache = CacheConfig::File(dir.to_path_buf());
            cfg.autotune.level = match kernels.autotune {
                Autotune::Fast => AutotuneLevel::Minimal,
                Autotune::Balanced => AutotuneLevel::Balanced,
                Autotune::Extensive => AutotuneLevel::Extensive,
                Autotune::Full => AutotuneLevel::Full,
            };
            CubeClRuntimeConfig::set(cfg);
        });
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::{BackendJob, KernelSettings};
    use crate::device::GpuInfo;

    pub fn run<J: BackendJob>(_: &[GpuInfo], _: &KernelSettings, _: J) -> J::Output {
        unreachable!("device::plan never picks CUDA in a build without the `cuda` feature")
    }
}
