//! Everything that exists only for CUDA, behind one entry point: [`configure`] routes
//! the backend extensions (`ops`) to the kernels a run asked for, and the `impl`s in
//! these modules put them behind Burn's CUDA backend and its fusion stream.
//!
//! - `cudnn/`: cuDNN's convolutions and batch normalisation (probe, handles, legacy
//!   calls, the graph API);
//! - `norm_kernels`, `sgd`: kiln's own cubecl kernels;
//! - `nccl`: collectives of device buffers across GPUs and processes (`copies`: many
//!   device-to-device copies by one driver call);
//! - `pinned`, `staging`: uploads from page-locked host memory, beside the step;
//! - `kiln_stream`, `cubecl_stream`, `stream_order`: how kiln's GPU work is queued in
//!   order with cubecl's;
//! - `fusion`: each extension as one custom operation of Burn's fusion stream.

mod copies;
mod cubecl_stream;
pub mod cudnn;
mod fusion;
mod kiln_stream;
pub mod nccl;
pub mod norm_kernels;
pub mod pinned;
mod sgd;
mod staging;
mod stream_order;

pub(crate) use kiln_stream::kiln_waits;

/// Which kernels the CUDA backend's extensions run; set once, before the first
/// training step.
#[derive(Debug, Clone, Copy, Default)]
pub struct Routing {
    /// Convolutions on cuDNN (after [`cudnn::probe`] succeeded).
    pub cudnn_convolutions: bool,
    /// BatchNorm's training pass on cuDNN (after [`cudnn::probe_batch_norm`]).
    pub cudnn_batch_norm: bool,
    /// BatchNorm on kiln's own kernels (both layouts), ahead of cuDNN.
    pub kiln_norm: bool,
    /// Batches uploaded from page-locked memory.
    pub pinned_uploads: bool,
    /// The most scratch memory one cuDNN convolution may take, in bytes.
    pub conv_workspace: usize,
}

/// Routes the extensions as `routing` says.
pub fn configure(routing: Routing) {
    cudnn::set_convolutions(routing.cudnn_convolutions);
    cudnn::set_workspace_limit(routing.conv_workspace);
    cudnn::set_batch_norm(routing.cudnn_batch_norm);
    norm_kernels::set_enabled(routing.kiln_norm);
    pinned::set_pinned(routing.pinned_uploads);
}

/// cubecl's device memory pool of the calling thread's stream on GPU `ordinal`, and
/// what kiln holds beside it (cuDNN's workspace, the upload's staging buffers; the sum
/// of their peaks). cubecl keeps one pool per stream and
/// returns nothing to the driver unless asked, which kiln never does, so what is
/// reserved at the end is the peak (what PyTorch calls `max_memory_reserved`, which
/// counts cuDNN's workspace too).
pub fn pool_usage(ordinal: usize) -> Option<crate::train::PoolUsage> {
    use burn::backend::cuda::CudaDevice;
    use burn::cubecl::Runtime;
    use burn::cubecl::cuda::CudaRuntime;
    let usage = CudaRuntime::client(&CudaDevice::new(ordinal))
        .memory_usage()
        .ok()?;
    Some(crate::train::PoolUsage {
        in_use: usage.bytes_in_use,
        reserved: usage.bytes_reserved,
        beside_peak: cudnn::workspace_peak(ordinal) + staging::staging_peak(ordinal),
    })
}
