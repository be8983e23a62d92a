//! The ResNet network: stem, residual stages, global average pool, classifier.

use crate::ops::{ModelBackend, batch_norm};
use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::Tensor;
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;

use super::block::{Basic, Block, Bottleneck, bn, conv};
use super::flavors::{BlockKind, layout};
use super::precision;
use crate::config::{Arch, Precision, Stem};

/// Everything that fixes the network's parameter shapes. Two checkpoints are
/// compatible exactly when their specs are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelSpec {
    pub arch: Arch,
    /// Resolved: never `Auto`.
    pub stem: Stem,
    pub in_channels: usize,
    pub num_classes: usize,
}

impl ModelSpec {
    /// Resolves `Stem::Auto` from the image side.
    pub fn new(
        arch: Arch,
        stem: Stem,
        in_channels: usize,
        num_classes: usize,
        image_side: usize,
    ) -> Self {
        let stem = match stem {
            Stem::Auto if image_side <= 64 => Stem::Small,
            Stem::Auto => Stem::Imagenet,
            s => s,
        };
        ModelSpec {
            arch,
            stem,
            in_channels,
            num_classes,
        }
    }

    pub fn init<B: ModelBackend>(&self, device: &B::Device) -> ResNet<B> {
        let l = layout(self.arch);
        let (stem_conv, stem_pool) = match self.stem {
            Stem::Imagenet => {
                let pool = MaxPool2dConfig::new([3, 3])
                    .with_strides([2, 2])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init();
                (
                    conv(self.in_channels, l.stem_width, 7, 2, device),
                    Some(pool),
                )
            }
            _ => (conv(self.in_channels, l.stem_width, 3, 1, device), None),
        };
        let mut blocks = Vec::new();
        let mut cin = l.stem_width;
        for (stage, (&width, &depth)) in l.widths.iter().zip(&l.depths).enumerate() {
            for i in 0..depth {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                let block = match l.block {
                    BlockKind::Basic => {
                        let b = Block::Basic(Basic::new(cin, width, stride, device));
                        cin = width;
                        b
                    }
                    BlockKind::Bottleneck => {
                        let b = Block::Bottleneck(Bottleneck::new(cin, width, stride, device));
                        cin = width * 4;
                        b
                    }
                };
                blocks.push(block);
            }
        }
        super::materialize(ResNet {
            stem_conv,
            stem_bn: bn(l.stem_width, device),
            stem_pool,
            blocks,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(cin, self.num_classes).init(device),
            precision: Precision::Fp32,
        })
    }
}

#[derive(Module, Debug)]
pub struct ResNet<B: Backend> {
    stem_conv: Conv2d<B>,
    stem_bn: BatchNorm<B>,
    stem_pool: Option<MaxPool2d>,
    blocks: Vec<Block<B>>,
    pool: AdaptiveAvgPool2d,
    fc: Linear<B>,
    /// How convolutions and the classifier compute; not part of the weights, so a
    /// checkpoint resumes under any precision.
    #[module(skip)]
    precision: Precision,
}

impl<B: ModelBackend> ResNet<B> {
    /// The same network computing its convolutions and classifier in `precision`
    /// (`train.precision`; see `model::precision`).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// # Shapes
    /// - `images`: `[batch, in_channels, H, W]`
    /// - returns logits: `[batch, num_classes]`
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let p = self.precision;
        let mut x = relu(batch_norm(
            &self.stem_bn,
            precision::conv(&self.stem_conv, images, p),
        ));
        if let Some(pool) = &self.stem_pool {
            x = pool.forward(x);
        }
        for block in &self.blocks {
            x = block.forward(x, p);
        }
        let x = self.pool.forward(x); // [B, C, 1, 1]
        precision::dense(&self.fc, x.flatten(1, 3), p) // [B, C] -> [B, classes]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, device, rng_lock};
    use burn::tensor::Distribution;

    #[test]
    fn every_variant_maps_images_to_one_logit_per_class() {
        let _rng = rng_lock();
        let dev = device();
        for (arch, stem, side, channels) in [
            (Arch::Tiny, Stem::Auto, 12, 1),
            (Arch::Resnet20, Stem::Auto, 28, 1),
            (Arch::Resnet32, Stem::Small, 16, 3),
            (Arch::Resnet56, Stem::Small, 8, 3),
            (Arch::Resnet18, Stem::Auto, 32, 3),
            (Arch::Resnet34, Stem::Small, 8, 1),
            (Arch::Resnet50, Stem::Imagenet, 64, 3),
        ] {
            let spec = ModelSpec::new(arch, stem, channels, 7, side);
            let model = spec.init::<TestBackend>(&dev);
            let x = Tensor::random(
                [2, channels, side, side],
                Distribution::Normal(0.0, 1.0),
                &dev,
            );
            assert_eq!(model.forward(x).dims(), [2, 7], "{arch:?}");
        }
    }

    #[test]
    fn auto_stem_follows_image_size() {
        assert_eq!(
            ModelSpec::new(Arch::Resnet18, Stem::Auto, 3, 10, 32).stem,
            Stem::Small
        );
        assert_eq!(
            ModelSpec::new(Arch::Resnet18, Stem::Auto, 3, 10, 224).stem,
            Stem::Imagenet
        );
    }

    #[test]
    fn parameter_counts_match_torchvision() {
        use burn::module::Module;
        let _rng = rng_lock();
        let dev = device();
        // torchvision resnet18/50 with 1000 classes have 11,689,512 and 25,557,032
        // parameters. Burn's count also includes BatchNorm's running mean and variance:
        // 2 x 4,800 and 2 x 26,560 BatchNorm channels.
        let r18 =
            ModelSpec::new(Arch::Resnet18, Stem::Imagenet, 3, 1000, 224).init::<TestBackend>(&dev);
        assert_eq!(r18.num_params(), 11_689_512 + 2 * 4_800);
        let r50 =
            ModelSpec::new(Arch::Resnet50, Stem::Imagenet, 3, 1000, 224).init::<TestBackend>(&dev);
        assert_eq!(r50.num_params(), 25_557_032 + 2 * 26_560);
    }
}
