//! Backend extensions: operations kiln's models call through a trait of their own,
//! so a backend can put other kernels behind them: the convolution and BatchNorm's
//! training pass, which on CUDA can run on cuDNN (`train.convolution`,
//! `train.batch_norm`), and the upload of a batch, which on CUDA can read page-locked
//! memory (`data.pin_memory`).

mod conv;
#[cfg(feature = "cuda")]
pub mod cudnn;
#[cfg(feature = "cuda")]
mod fusion;
mod norm;
#[cfg(feature = "cuda")]
pub mod pinned;
#[cfg(feature = "cuda")]
mod stream_order;
mod upload;

pub use conv::{ConvBackend, conv2d};
pub use norm::{NormBackend, batch_norm};
pub use upload::{UploadBackend, upload_f32};

/// What kiln's models and steps call on a backend: its convolution, its BatchNorm and
/// its upload of a batch.
pub trait ModelBackend: ConvBackend + NormBackend + UploadBackend {}

impl<B: ConvBackend + NormBackend + UploadBackend> ModelBackend for B {}

/// The output shape (NKPQ) of a convolution of `x` (NCHW) by `weight` (KCRS).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn conv2d_output_dims(
    x: [usize; 4],
    weight: [usize; 4],
    options: &burn::tensor::ops::ConvOptions<2>,
) -> [usize; 4] {
    let out = |d: usize| {
        burn::tensor::ops::conv::calculate_conv_output_size(
            weight[2 + d],
            options.stride[d],
            options.padding[d],
            options.dilation[d],
            x[2 + d],
        )
    };
    [x[0], weight[0], out(0), out(1)]
}

/// Which convolutions run on cuDNN on CUDA; the others run on Burn's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudnnRoute {
    None,
    /// f32 only. On an H200, cuDNN's bfloat16 and float16 convolutions on kiln's NCHW
    /// tensors measured slower than Burn's own (BENCHMARKS.md, "cuDNN convolutions").
    Fp32,
    /// f32, bfloat16 and float16.
    All,
}

/// The three parts of a convolution a backend can replace.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Part {
    Forward,
    GradX,
    GradWeight,
}

/// What training needs of a backend: autodiff, and kiln's extensions both on it and
/// on the inner backend that evaluation runs on.
pub trait TrainBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: ModelBackend> + ModelBackend
{
}

impl<B> TrainBackend for B
where
    B: burn::tensor::backend::AutodiffBackend + ModelBackend,
    B::InnerBackend: ModelBackend,
{
}
