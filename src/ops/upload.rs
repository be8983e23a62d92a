//! [`UploadBackend`]: how a batch of images reaches the device, so a backend can
//! stage it in page-locked host memory (on CUDA, `data.pin_memory`: `ops::pinned`).
//! The default is Burn's `from_data`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

pub trait UploadBackend: Backend {
    /// `values` on `device` as a flat f32 tensor.
    fn upload_f32(values: Vec<f32>, device: &Self::Device) -> FloatTensor<Self> {
        pageable_upload::<Self>(values, device)
    }
}

/// Burn's own upload of `values` (`from_data`, from pageable memory), flat: the default,
/// and the CUDA backend's without page-locked staging.
pub(crate) fn pageable_upload<B: Backend>(values: Vec<f32>, device: &B::Device) -> FloatTensor<B> {
    let len = values.len();
    B::float_from_data(TensorData::new(values, [len]), device)
}

impl UploadBackend for Flex {}

/// A leaf of the graph, as `from_data` makes one: the inner backend uploads.
impl<B: UploadBackend, C: CheckpointStrategy> UploadBackend for Autodiff<B, C> {
    fn upload_f32(values: Vec<f32>, device: &Self::Device) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::upload_f32(values, device))
    }
}

/// `values` on `device` through [`UploadBackend`], flat.
pub fn upload_f32<B: UploadBackend>(values: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(B::upload_f32(values, device)))
}
