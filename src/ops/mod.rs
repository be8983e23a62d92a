//! Backend extensions: operations kiln's models and steps call through traits of their
//! own, so a backend can put other kernels behind them. The traits and their portable
//! versions (Burn's operations, which the CPU runs) are here; everything that exists
//! only for CUDA (cuDNN, kiln's kernels, streams, page-locked uploads, NCCL, the fusion
//! glue) is under `cuda/`, whose `mod.rs` is its one entry point.

mod activation;
mod collective;
mod conv;
#[cfg(feature = "cuda")]
pub mod cuda;
mod layout;
mod norm;
pub mod sgd;
mod upload;
mod waits;

pub use activation::ActivationBackend;
pub use collective::{CollectiveBackend, Comm};
pub use conv::{ConvBackend, conv2d};
pub use layout::Layout;
// What only the CUDA extensions (`cuda/`) use.
#[cfg(feature = "cuda")]
pub use collective::DeviceComm;
#[cfg(feature = "cuda")]
pub use conv::ConvPass;
#[cfg(feature = "cuda")]
pub(crate) use layout::conv2d_output_dims;
pub use norm::{NormBackend, batch_norm, batch_norm_add_relu, batch_norm_relu};
pub use sgd::{SgdBackend, SgdStep};
pub use upload::{UploadBackend, upload_f32};
pub use waits::{KilnWaits, LibraryCall, kiln_waits};

/// What kiln's models and steps call on a backend: its convolution, its BatchNorm, its
/// ReLU, its upload of a batch, its optimizer step and its collectives.
pub trait ModelBackend:
    ConvBackend + NormBackend + ActivationBackend + UploadBackend + SgdBackend + CollectiveBackend
{
}

impl<
    B: ConvBackend + NormBackend + ActivationBackend + UploadBackend + SgdBackend + CollectiveBackend,
> ModelBackend for B
{
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
