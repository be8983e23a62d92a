//! One optimizer step on one global batch, and one evaluation pass. Metrics stay on
//! the device as running sums; the trainer reads them back only when it reports.

use crate::ops::SgdBackend;
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

use super::clip::clip_global_norm;
use super::loss::{correct, cross_entropy};
use super::loss_scale::unscale;
use super::optim::Optim;
use crate::config::TrainConfig;
use crate::data::Batch;
use crate::model::Classifier;
use crate::ops::{UploadBackend, upload_f32};

/// Device-side sums over the images seen: loss times images, and correct predictions.
#[derive(Clone)]
pub struct Sums<B: Backend> {
    pub loss: Tensor<B, 1>,
    pub correct: Tensor<B, 1, Int>,
    pub images: usize,
}

impl<B: Backend> Sums<B> {
    pub fn add(self, other: Sums<B>) -> Sums<B> {
        Sums {
            loss: self.loss + other.loss,
            correct: self.correct + other.correct,
            images: self.images + other.images,
        }
    }

    /// Nothing seen yet, on `device`.
    pub fn zeros(device: &B::Device) -> Sums<B> {
        Sums {
            loss: Tensor::zeros([1], device),
            correct: Tensor::zeros([1], device),
            images: 0,
        }
    }

    /// Adds to `acc`, which may be empty.
    pub fn accumulate(acc: Option<Sums<B>>, other: Sums<B>) -> Option<Sums<B>> {
        Some(match acc {
            Some(a) => a.add(other),
            None => other,
        })
    }

    /// Reads the sums back: loss times images, correct predictions, images.
    pub fn totals(self) -> (f64, f64, usize) {
        use burn::tensor::ElementConversion;
        let loss: f64 = self.loss.into_scalar().elem();
        let correct: f64 = self.correct.into_scalar().elem();
        (loss, correct, self.images)
    }
}

/// The batch on `device`: images through [`UploadBackend`] (page-locked staging on
/// CUDA with `data.pin_memory`), labels as they are.
pub fn to_device<B: UploadBackend>(
    batch: Batch,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 1, Int>) {
    let n = batch.labels.len();
    // Uploaded flat, then reshaped (free): cubecl 0.10 may pad the rows of a tensor of
    // rank 2 or more, and the result is contiguous either way, as cuDNN takes it.
    let images = upload_f32::<B>(batch.images, device).reshape(batch.shape);
    let labels = Tensor::from_data(TensorData::new(batch.labels, [n]), device);
    (images, labels)
}

/// Forward and backward on one batch, with the loss scaled by `weight` so that the
/// gradients of several pieces of a global batch sum to the gradient of its mean loss
/// (`weight` = images in the piece / images in the global batch).
pub fn forward_backward<
    B: AutodiffBackend + UploadBackend,
    M: Classifier<B> + AutodiffModule<B>,
>(
    model: &M,
    batch: Batch,
    device: &B::Device,
    weight: f64,
    label_smoothing: f64,
) -> (GradientsParams, Sums<B::InnerBackend>) {
    let (images, labels) = to_device::<B>(batch, device);
    let n = labels.dims()[0];
    let logits = model.forward(images);
    let loss = cross_entropy(logits.clone(), labels.clone(), label_smoothing);
    let sums = Sums {
        loss: loss.clone().detach().inner().mul_scalar(n as f64),
        correct: correct(logits.detach().inner(), labels.inner()),
        images: n,
    };
    let loss = if weight == 1.0 {
        loss
    } else {
        loss.mul_scalar(weight)
    };
    let grads = GradientsParams::from_grads(loss.backward(), model);
    (grads, sums)
}

/// The `grad_accum_steps` micro-batches of a global batch.
pub fn micro_batches(batch: Batch, cfg: &TrainConfig) -> Vec<Batch> {
    let k = cfg.grad_accum_steps.max(1);
    let n = batch.labels.len();
    if k == 1 {
        return vec![batch];
    }
    batch.split(&vec![n / k; k])
}

/// Clipping (if configured) and one optimizer step at `lr` with the summed gradients;
/// see [`apply_clipped`].
pub fn apply<B: AutodiffBackend<InnerBackend: SgdBackend>, M: AutodiffModule<B>>(
    model: M,
    optim: &mut Optim<M, B>,
    grads: GradientsParams,
    lr: f64,
    cfg: &TrainConfig,
    scale: Option<f64>,
) -> (M, bool) {
    apply_clipped(model, optim, grads, lr, cfg.grad_clip_norm, scale)
}

/// One optimizer step, the gradients' global norm clipped to `clip` first (0: off).
/// With a loss `scale` (fp16) the gradients are divided by it first, and a step whose
/// gradients overflowed is skipped: the flag says whether the step was taken.
pub fn apply_clipped<B: AutodiffBackend<InnerBackend: SgdBackend>, M: AutodiffModule<B>>(
    model: M,
    optim: &mut Optim<M, B>,
    mut grads: GradientsParams,
    lr: f64,
    clip: f64,
    scale: Option<f64>,
) -> (M, bool) {
    if let Some(scale) = scale
        && !unscale::<B, M>(&model, &mut grads, scale)
    {
        return (model, false);
    }
    if clip > 0.0 {
        clip_global_norm::<B, _>(&model, &mut grads, clip);
    }
    (optim.step(lr, model, grads), true)
}

/// Trains on one global batch on one device: its micro-batches' gradients summed,
/// then one optimizer step (skipped, and `false`, when fp16 gradients overflowed).
pub fn train_step<
    B: AutodiffBackend<InnerBackend: SgdBackend> + UploadBackend,
    M: Classifier<B> + AutodiffModule<B>,
>(
    model: M,
    optim: &mut Optim<M, B>,
    batch: Batch,
    lr: f64,
    cfg: &TrainConfig,
    device: &B::Device,
    scale: Option<f64>,
) -> (M, Sums<B::InnerBackend>, bool) {
    let total = batch.labels.len();
    let (grads, sums) = local_grads(&model, batch, total, cfg, device, scale);
    let (model, stepped) = apply(model, optim, grads, lr, cfg, scale);
    (model, sums, stepped)
}

/// The summed gradients of `batch`'s micro-batches, each loss weighted by its images'
/// share of a global batch of `global_images` (more than the batch's own when it is
/// one process's shard of it).
pub fn local_grads<B: AutodiffBackend + UploadBackend, M: Classifier<B> + AutodiffModule<B>>(
    model: &M,
    batch: Batch,
    global_images: usize,
    cfg: &TrainConfig,
    device: &B::Device,
    scale: Option<f64>,
) -> (GradientsParams, Sums<B::InnerBackend>) {
    let total = global_images as f64;
    let mut acc = GradientsAccumulator::<M>::new();
    let mut sums = None;
    for micro in micro_batches(batch, cfg) {
        let weight = micro.labels.len() as f64 / total * scale.unwrap_or(1.0);
        let (g, s) = forward_backward(model, micro, device, weight, cfg.label_smoothing);
        acc.accumulate(model, g);
        sums = Sums::accumulate(sums, s);
    }
    let sums = sums.expect("a batch has at least one micro-batch");
    (acc.grads(), sums)
}

/// Loss and accuracy sums of `model` (BatchNorm in inference mode) on one batch.
pub fn eval_batch<B: UploadBackend, M: Classifier<B>>(
    model: &M,
    batch: Batch,
    device: &B::Device,
) -> Sums<B> {
    let (images, labels) = to_device::<B>(batch, device);
    let n = labels.dims()[0];
    let logits = model.forward(images);
    Sums {
        loss: cross_entropy(logits.clone(), labels.clone(), 0.0).mul_scalar(n as f64),
        correct: correct(logits, labels),
        images: n,
    }
}
