//! `[kernels]`: which kernels compute the network on CUDA and how they are chosen.
//! None of these change what is trained, only how fast and in how much memory.

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

/// How hard cubecl searches for the fastest kernel of each new shape (CUDA only).
/// Results are cached, so only the first run on a machine pays for the search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Autotune {
    /// cubecl's `minimal`: fewest shape groups, shortest first steps.
    Fast,
    /// cubecl's default.
    Balanced,
    /// cubecl's `extensive`.
    Extensive,
    /// cubecl's `full`: tunes every shape on its own.
    Full,
}

/// Which kernels run convolutions on CUDA (forward and both gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Convolution {
    /// cuDNN when it can be loaded (`libcudnn.so.9` on the library path), otherwise
    /// Burn's kernels, with a note saying why.
    Auto,
    /// As `auto`, but an error before training starts when cuDNN cannot be loaded.
    Cudnn,
    /// Burn's own implicit-GEMM kernels.
    Burn,
}

/// Which kernels run BatchNorm's training pass on CUDA (batch statistics, forward and
/// backward). Evaluation always uses Burn's element-wise pass with the running
/// statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchNormKernels {
    /// kiln's own kernels (`ops::cuda::norm_kernels`) in both layouts: three launches
    /// each way per layer, with the ReLU after it, a residual block's addition and the
    /// running statistics' update in their passes.
    Auto,
    /// cuDNN in both layouts, or an error before training starts when it cannot be
    /// loaded.
    Cudnn,
    /// Burn's element-wise and reduction operations (about a dozen per layer forward).
    Burn,
}

/// How cubecl's pool hands out device memory (CUDA only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryPool {
    /// Buffers kept per size and handed out again only for that size, never freed: a
    /// training step asks for the same sizes every time, so the pool holds about what
    /// the step uses at its peak; a size that comes once keeps its buffers too.
    Exact,
    /// cubecl's default: slices of pages in fixed size classes (on an H200 any buffer
    /// of 70-562 MiB opens a 2.19 GiB page), which serve any size; for work whose
    /// shapes keep changing.
    Pages,
}

/// `[kernels]`: kernel choices on CUDA; the CPU runs Burn's kernels whatever is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KernelsConfig {
    /// Kernel autotuning on CUDA; ignored on the CPU.
    pub autotune: Autotune,
    /// Convolution kernels on CUDA: `auto`, `cudnn` or `burn`.
    pub convolution: Convolution,
    /// BatchNorm's training kernels on CUDA: `auto`, `cudnn` or `burn`.
    pub batch_norm: BatchNormKernels,
    /// Activations as `[N, H, W, C]` and convolution weights as `[K, R, S, C]` inside
    /// the network (`model::precision`); with bf16/fp16 the activations also stay in
    /// the low precision between layers. On CUDA it needs cuDNN's convolutions and batch
    /// norm on kiln's or cuDNN's kernels, and the run stops before training without them.
    pub channels_last: bool,
    /// The most device memory one cuDNN convolution may use as scratch space, in MiB;
    /// cuDNN's fastest proposal that fits is taken. The calls share one workspace, as
    /// large as the largest plan's (ResNet-50's: 104 MiB), so the default leaves cuDNN
    /// its fastest plans; a smaller bound slows steps (BENCHMARKS.md, "Memory").
    pub conv_workspace_mib: u32,
    /// How device memory is pooled on CUDA: `exact` or `pages`.
    pub memory_pool: MemoryPool,
    /// Recompute memory-bound activations in the backward pass instead of keeping them
    /// (Burn's balanced checkpointing).
    pub gradient_checkpointing: bool,
}

impl Default for KernelsConfig {
    fn default() -> Self {
        Self {
            autotune: Autotune::Balanced,
            convolution: Convolution::Auto,
            batch_norm: BatchNormKernels::Auto,
            channels_last: false,
            conv_workspace_mib: DEFAULT_CONV_WORKSPACE_MIB,
            memory_pool: MemoryPool::Exact,
            gradient_checkpointing: false,
        }
    }
}

/// `conv_workspace_mib`'s default: room for cuDNN's fastest plans.
pub const DEFAULT_CONV_WORKSPACE_MIB: u32 = 1024;

/// Far above any plan measured (the ResNets' largest asked for 104 MiB); a larger
/// figure is more likely a typo than a wish.
const MAX_CONV_WORKSPACE_MIB: u32 = 4096;

impl KernelsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Every combination parses; whether the machine can run it (cuDNN present) is
        // decided when the kernels are set up, not here.
        if self.conv_workspace_mib > MAX_CONV_WORKSPACE_MIB {
            return Err(ConfigError::invalid(
                "kernels.conv_workspace_mib",
                self.conv_workspace_mib.to_string(),
                format!("0 to {MAX_CONV_WORKSPACE_MIB} (MiB)"),
            ));
        }
        Ok(())
    }
}
