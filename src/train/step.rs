//! One optimizer step on one global batch, and one evaluation pass. Metrics stay on
//! the device as running sums; the trainer reads them back only when it reports.

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

use super::clip::clip_global_norm;
use super::loss::{correct, cross_entropy};
use super::optim::Optim;
use crate::config::TrainConfig;
use crate::data::Batch;
use crate::model::ResNet;

/// Device-side sums over the images seen: loss times images, and correct predictions.
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

    /// Reads the sums back (one device synchronisation): mean loss and accuracy.
    pub fn read(self) -> (f64, f64) {
        use burn::tensor::ElementConversion;
        let n = self.images.max(1) as f64;
        let loss: f64 = self.loss.into_scalar().elem();
        let correct: f64 = self.correct.into_scalar().elem();
        (loss / n, correct / n)
    }
}

pub fn to_device<B: Backend>(
    batch: Batch,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 1, Int>) {
    let n = batch.labels.len();
    let images = Tensor::from_data(TensorData::new(batch.images, batch.shape), device);
    let labels = Tensor::from_data(TensorData::new(batch.labels, [n]), device);
    (images, labels)
}

/// Forward and backward on `images`, with the loss scaled by `weight` so that
/// gradients of several micro-batches sum to the gradient of their union.
fn forward_backward<B: AutodiffBackend>(
    model: &ResNet<B>,
    images: Tensor<B, 4>,
    labels: Tensor<B, 1, Int>,
    weight: f64,
    label_smoothing: f64,
) -> (GradientsParams, Sums<B::InnerBackend>) {
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

/// Trains on one global batch: `grad_accum_steps` micro-batches, summed gradients,
/// optional global-norm clipping, one optimizer step at `lr`.
pub fn train_step<B: AutodiffBackend>(
    model: ResNet<B>,
    optim: &mut Optim<ResNet<B>, B>,
    batch: Batch,
    lr: f64,
    cfg: &TrainConfig,
    device: &B::Device,
) -> (ResNet<B>, Sums<B::InnerBackend>) {
    let (images, labels) = to_device::<B>(batch, device);
    let micro = cfg.grad_accum_steps;
    let (mut grads, sums) = if micro == 1 {
        forward_backward(&model, images, labels, 1.0, cfg.label_smoothing)
    } else {
        let n = labels.dims()[0];
        let size = n / micro;
        let mut acc = GradientsAccumulator::<ResNet<B>>::new();
        let mut total: Option<Sums<B::InnerBackend>> = None;
        for i in 0..micro {
            let (lo, hi) = (i * size, (i + 1) * size);
            let (g, s) = forward_backward(
                &model,
                images.clone().slice(lo..hi),
                labels.clone().slice(lo..hi),
                1.0 / micro as f64,
                cfg.label_smoothing,
            );
            acc.accumulate(&model, g);
            total = Some(match total {
                Some(t) => t.add(s),
                None => s,
            });
        }
        (acc.grads(), total.expect("grad_accum_steps is at least 1"))
    };
    if cfg.grad_clip_norm > 0.0 {
        clip_global_norm::<B, _>(&model, &mut grads, cfg.grad_clip_norm);
    }
    (optim.step(lr, model, grads), sums)
}

/// Loss and accuracy sums of `model` (BatchNorm in inference mode) on one batch.
pub fn eval_batch<B: Backend>(model: &ResNet<B>, batch: Batch, device: &B::Device) -> Sums<B> {
    let (images, labels) = to_device::<B>(batch, device);
    let n = labels.dims()[0];
    let logits = model.forward(images);
    Sums {
        loss: cross_entropy(logits.clone(), labels.clone(), 0.0).mul_scalar(n as f64),
        correct: correct(logits, labels),
        images: n,
    }
}
