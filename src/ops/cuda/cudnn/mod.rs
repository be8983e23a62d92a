//! cuDNN's convolutions behind Burn's CUDA backend (`kernels.convolution`).
//!
//! Burn 0.21's implicit-GEMM convolutions were two thirds of a ResNet-18 step on an
//! H200 (BENCHMARKS.md, "Where the time goes"). cuDNN is loaded at run time (cudarc's
//! bindings, cuDNN 9) and probed before training; a call it refuses (a shape or dtype
//! without an algorithm) runs on Burn's kernels.
//!
//! cubecl keeps its CUDA streams private. cuDNN runs on the calling thread's cubecl
//! stream itself where kiln has learnt which it is (`cubecl_stream`, through CUPTI),
//! in order with cubecl's kernels; otherwise on kiln's own stream (`kiln_stream`),
//! ordered against cubecl's on the GPU (`stream_order`). Either way the host queues
//! the call and goes on. Where neither can be set up, the call waits on the host for
//! cubecl's stream before and for its own after, as the first version did (two host
//! synchronisations per convolution, each draining the GPU's queue).
//!
//! A call runs whole on cubecl's device thread: the device addresses of a call's
//! buffers are known only there, and each question asked from the fusion thread that
//! queues the call is a blocking round trip that waits for that thread's queue to
//! drain. Each shape's first call is one such trip (`ComputeClient::exclusive`), so a
//! shape cuDNN refuses reports it; later calls are queued there without waiting
//! (`on_cudnn_planned`). Each shape's execution plan is made once (`graph`, cuDNN's
//! graph API; the legacy calls' descriptors and algorithm where that cannot plan it)
//! and kept with the thread's cuDNN handle.

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::cubecl::cuda::CudaRuntime;
use burn::tensor::ops::ConvOptions;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cudnn::{result as dnn, sys};

use super::kiln_stream::with_lane;
use crate::ops::{ConvPass, Layout};

mod batch_norm;
mod conv;
mod graph;
mod handle;
mod legacy;

use batch_norm::{NormDescriptors, NormKey};
pub use batch_norm::{probe_batch_norm, set_batch_norm};
pub use conv::set_convolutions;
use conv::{Conv, ConvKey, dims, warn_once};
use graph::GraphPlan;
pub use handle::workspace_peak;
use handle::{Dnn, Planned, on_cudnn_planned, with_cudnn};
use legacy::{data_type, scaling, tensor_format};

type Tensor = CubeTensor<CudaRuntime>;

static WORKSPACE_LIMIT: AtomicUsize =
    AtomicUsize::new((crate::config::DEFAULT_CONV_WORKSPACE_MIB as usize) << 20);

/// The most workspace one convolution gets (`kernels.conv_workspace_mib`); a plan that
/// asks for more is passed over for cuDNN's next proposal. Set once, before training.
pub fn set_workspace_limit(bytes: usize) {
    WORKSPACE_LIMIT.store(bytes, Ordering::Relaxed);
}

fn workspace_limit() -> usize {
    WORKSPACE_LIMIT.load(Ordering::Relaxed)
}

const TENSOR_OP: sys::cudnnMathType_t = sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH;

/// Whether cuDNN can be loaded and can plan a convolution on GPU `ordinal`: its
/// version on success, what failed otherwise.
pub fn probe(ordinal: usize) -> Result<String, String> {
    // cudarc panics when the library is missing, so look for it first, by the names
    // it will try.
    // SAFETY: loading cuDNN runs no initialisation code with preconditions.
    if !unsafe { sys::is_culib_present() } {
        return Err("libcudnn.so (cuDNN 9) was not found on the library path".into());
    }
    let version = dnn::get_version();
    if version < 90000 {
        return Err(format!("cuDNN {version} is older than 9.0"));
    }
    // SAFETY: the version checks take no arguments; they load the convolution and
    // operation sub-libraries, whose absence shows here rather than mid-training.
    unsafe {
        sys::cudnnCnnVersionCheck()
            .result()
            .map_err(|e| format!("cuDNN's convolution library: {e:?}"))?;
        sys::cudnnOpsVersionCheck()
            .result()
            .map_err(|e| format!("cuDNN's operations library: {e:?}"))?;
    }
    with_lane(ordinal, |lane| {
        let stream = lane.stream();
        with_cudnn(ordinal, lane, stream, |dnn, _, handle| {
            // A small convolution planned end to end, as training will.
            let key = ConvKey {
                part: ConvPass::Forward,
                data: sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                dims: [[8, 16, 32, 32], [16, 16, 3, 3], [8, 16, 32, 32]],
                options: ConvOptions::new([1, 1], [1, 1], [1, 1], 1),
                layout: Layout::Nchw,
                accumulate: false,
            };
            dnn.conv(&key, handle).map(|_| ())
        })
    })?;
    Ok(format!(
        "{}.{}.{}",
        version / 10000,
        version / 100 % 100,
        version % 100
    ))
}

/// Whether the loaded cuDNN has every one of `names`: cudarc panics at the first call
/// of a symbol a slimmed install lacks.
fn has_symbols(names: &[&str]) -> Result<(), String> {
    for name in names {
        // SAFETY: only looks the symbol up; `probe` has loaded the library.
        let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) };
        found.map_err(|e| format!("{name} is missing from cuDNN: {e}"))?;
    }
    Ok(())
}
