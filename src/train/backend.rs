//! The only module that names concrete backends. Every command that does tensor work
//! goes through [`with_backend`], so the generic stack is instantiated once per
//! compiled backend: `Autodiff<Cuda>` and `Autodiff<Flex>` (the CPU); training work
//! goes through [`with_training_backend`], which adds both with Burn's
//! `BalancedCheckpointing` for `kernels.gradient_checkpointing`.

use std::path::PathBuf;

use crate::ops::TrainBackend;
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::flex::{Flex, FlexDevice};

use crate::config::Autotune;
use crate::device::DevicePlan;

/// How cubecl compiles and tunes kernels; read once, before the first CUDA call.
#[derive(Debug, Clone)]
pub struct KernelSettings {
    /// Compiled kernels and autotune results, kept across runs.
    pub cache_dir: PathBuf,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub autotune: Autotune,
    /// Whether convolutions run on cuDNN (after [`probe_cudnn`] succeeded) instead of
    /// Burn's kernels.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub cudnn_convolutions: bool,
    /// Whether BatchNorm's training pass runs on cuDNN (after
    /// [`probe_cudnn_batch_norm`] succeeded).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub cudnn_batch_norm: bool,
    /// Whether BatchNorm's training pass runs on kiln's own kernels
    /// (`ops::cuda::norm_kernels`, both layouts), ahead of cuDNN.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub kiln_norm: bool,
    /// The most scratch memory one cuDNN convolution may take, in bytes.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub conv_workspace: usize,
    /// Whether device memory comes from cubecl's exact-size pool
    /// (`kernels.memory_pool = "exact"`) instead of its pages.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub exact_pool: bool,
    /// Whether batches are uploaded from page-locked memory (`data.pin_memory`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub pinned_uploads: bool,
}

/// cuDNN's version if it can be loaded and plan a convolution on GPU `ordinal`, else
/// why not.
pub fn probe_cudnn(ordinal: usize) -> Result<String, String> {
    #[cfg(feature = "cuda")]
    return crate::ops::cuda::cudnn::probe(ordinal);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err("kiln was built without CUDA".into())
    }
}

/// Whether the cuDNN that [`probe_cudnn`] found has the batch normalisation kernels.
pub fn probe_cudnn_batch_norm() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    return crate::ops::cuda::cudnn::probe_batch_norm();
    #[cfg(not(feature = "cuda"))]
    Err("kiln was built without CUDA".into())
}

/// Work that runs on whichever backend the plan picks.
pub trait BackendJob {
    type Output;
    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output;
}

pub fn with_backend<J: BackendJob>(
    plan: &DevicePlan,
    kernels: &KernelSettings,
    job: J,
) -> J::Output {
    run_with::<J, NoCheckpointing>(plan, kernels, job)
}

/// [`with_backend`] for jobs that train: `recompute` (`kernels.gradient_checkpointing`)
/// makes the autodiff graph keep only the outputs of compute-bound operations
/// (convolutions, matmuls) and recompute the memory-bound ones (BatchNorm's arithmetic,
/// ReLU, additions) during the backward pass, trading time for activation memory.
pub fn with_training_backend<J: BackendJob>(
    plan: &DevicePlan,
    kernels: &KernelSettings,
    recompute: bool,
    job: J,
) -> J::Output {
    if recompute {
        run_with::<J, BalancedCheckpointing>(plan, kernels, job)
    } else {
        with_backend(plan, kernels, job)
    }
}

fn run_with<J: BackendJob, C: CheckpointStrategy>(
    plan: &DevicePlan,
    kernels: &KernelSettings,
    job: J,
) -> J::Output {
    match plan {
        DevicePlan::Cuda { gpus, .. } => cuda::run::<J, C>(gpus, kernels, job),
        DevicePlan::Cpu { .. } => job.run::<Autodiff<Flex, C>>(vec![FlexDevice]),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Once;

    use burn::backend::Autodiff;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::cuda::{Cuda, CudaDevice};
    use burn::cubecl::config::autotune::AutotuneLevel;
    use burn::cubecl::config::cache::CacheConfig;
    use burn::cubecl::config::memory::PersistentMemory;
    use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

    use super::{BackendJob, KernelSettings};
    use crate::config::Autotune;
    use crate::device::GpuInfo;

    pub fn run<J: BackendJob, C: CheckpointStrategy>(
        gpus: &[GpuInfo],
        kernels: &KernelSettings,
        job: J,
    ) -> J::Output {
        configure(kernels);
        job.run::<Autodiff<Cuda, C>>(gpus.iter().map(|g| CudaDevice::new(g.ordinal)).collect())
    }

    /// Points cubecl's compiled-kernel and autotune caches at `dir` before the first
    /// device call. (Compiled kernels are not cached at all by default, so every run
    /// would pay minutes of NVRTC compilation again.) `kernels.memory_pool = "exact"`
    /// makes every allocation cubecl's persistent kind, one buffer per size, reused
    /// for that size. A user's `cubecl.toml` and `CUBECL_*` variables still apply to
    /// everything else.
    fn configure(kernels: &KernelSettings) {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let dir = &kernels.cache_dir;
            let _ = std::fs::create_dir_all(dir);
            let mut cfg = CubeClRuntimeConfig::from_current_dir().override_from_env();
            cfg.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
            cfg.autotune.cache = CacheConfig::File(dir.to_path_buf());
            if kernels.exact_pool {
                cfg.memory.persistent_memory = PersistentMemory::Enforced;
            }
            cfg.autotune.level = match kernels.autotune {
                Autotune::Fast => AutotuneLevel::Minimal,
                Autotune::Balanced => AutotuneLevel::Balanced,
                Autotune::Extensive => AutotuneLevel::Extensive,
                Autotune::Full => AutotuneLevel::Full,
            };
            CubeClRuntimeConfig::set(cfg);
            crate::ops::cuda::configure(crate::ops::cuda::Routing {
                cudnn_convolutions: kernels.cudnn_convolutions,
                cudnn_batch_norm: kernels.cudnn_batch_norm,
                kiln_norm: kernels.kiln_norm,
                conv_workspace: kernels.conv_workspace,
                pinned_uploads: kernels.pinned_uploads,
            });
        });
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::{BackendJob, CheckpointStrategy, KernelSettings};
    use crate::device::GpuInfo;

    pub fn run<J: BackendJob, C: CheckpointStrategy>(
        _: &[GpuInfo],
        _: &KernelSettings,
        _: J,
    ) -> J::Output {
        unreachable!("device::plan never picks CUDA in a build without the `cuda` feature")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, Config, Stem};
    use crate::data::Batch;
    use crate::model::{ModelSpec, ResNet};
    use crate::test_util::{floats, max_diff, rng_lock, tiny_batches};
    use crate::train::optim::Optim;
    use crate::train::step::train_step;

    /// Parameters and BatchNorm statistics after three SGD steps of the tiny ResNet.
    fn trained<B: TrainBackend<Device = FlexDevice>>(batches: &[Batch]) -> Vec<f32> {
        let cfg = Config::default();
        B::seed(&FlexDevice, 3);
        let mut model: ResNet<B> =
            ModelSpec::new(Arch::Tiny, Stem::Small, 3, 3, 8).init(&FlexDevice);
        let mut optim = Optim::new(&cfg.optim);
        for b in batches {
            model = train_step(
                model,
                &mut optim,
                b.clone(),
                0.1,
                &cfg.train,
                &FlexDevice,
                None,
            )
            .0;
        }
        floats::<B, _>(&model)
    }

    #[test]
    fn recomputing_activations_gives_the_same_training() {
        let _rng = rng_lock();
        let batches = tiny_batches();
        let kept = trained::<Autodiff<Flex>>(&batches);
        let recomputed = trained::<Autodiff<Flex, BalancedCheckpointing>>(&batches);
        assert_eq!(kept.len(), recomputed.len());
        let diff = max_diff(&kept, &recomputed);
        assert!(diff < 1e-5, "parameters differ by {diff}");
    }
}
