//! Residual blocks: the basic two-3x3 block (ResNet-18/34 and the CIFAR ResNets) and
//! the 1x1-3x3-1x1 bottleneck (ResNet-50, stride on the 3x3 as torchvision's v1.5).

use crate::ops::{ModelBackend, batch_norm, batch_norm_add_relu, batch_norm_relu};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Initializer, PaddingConfig2d};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::precision::{self, Compute};

/// He-normal, fan-out, as torchvision initialises ResNet convolutions.
fn he_normal() -> Initializer {
    Initializer::KaimingNormal {
        gain: std::f64::consts::SQRT_2,
        fan_out_only: true,
    }
}

pub fn conv<B: Backend>(
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    device: &B::Device,
) -> Conv2d<B> {
    let pad = k / 2;
    Conv2dConfig::new([cin, cout], [k, k])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .with_bias(false)
        .with_initializer(he_normal())
        .init(device)
}

pub fn bn<B: Backend>(channels: usize, device: &B::Device) -> BatchNorm<B> {
    BatchNormConfig::new(channels).init(device)
}

/// A 1x1 convolution and BatchNorm that match the shortcut to the block's output shape.
#[derive(Module, Debug)]
pub struct Projection<B: Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
}

impl<B: ModelBackend> Projection<B> {
    fn new(cin: usize, cout: usize, stride: usize, device: &B::Device) -> Self {
        Projection {
            conv: conv(cin, cout, 1, stride, device),
            bn: bn(cout, device),
        }
    }

    fn forward(&self, x: Tensor<B, 4>, c: Compute) -> Tensor<B, 4> {
        batch_norm(&self.bn, precision::conv(&self.conv, x, c), c.layout)
    }
}

/// Shortcut: identity when shapes match, else a projection.
fn shortcut<B: ModelBackend>(
    cin: usize,
    cout: usize,
    stride: usize,
    device: &B::Device,
) -> Option<Projection<B>> {
    (stride != 1 || cin != cout).then(|| Projection::new(cin, cout, stride, device))
}

#[derive(Module, Debug)]
pub struct Basic<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    shortcut: Option<Projection<B>>,
}

impl<B: ModelBackend> Basic<B> {
    pub fn new(cin: usize, cout: usize, stride: usize, device: &B::Device) -> Self {
        Basic {
            conv1: conv(cin, cout, 3, stride, device),
            bn1: bn(cout, device),
            conv2: conv(cout, cout, 3, 1, device),
            bn2: bn(cout, device),
            shortcut: shortcut(cin, cout, stride, device),
        }
    }

    /// `[B, cin, H, W] -> [B, cout, H / stride, W / stride]`
    pub fn forward(&self, x: Tensor<B, 4>, c: Compute) -> Tensor<B, 4> {
        let identity = match &self.shortcut {
            Some(s) => s.forward(x.clone(), c),
            None => x.clone(),
        };
        let y = batch_norm_relu(&self.bn1, precision::conv(&self.conv1, x, c), c.layout);
        let y = precision::conv(&self.conv2, y, c);
        batch_norm_add_relu(&self.bn2, y, identity, c.layout)
    }
}

#[derive(Module, Debug)]
pub struct Bottleneck<B: Backend> {
    conv1: Conv2d<B>,
    bn1: BatchNorm<B>,
    conv2: Conv2d<B>,
    bn2: BatchNorm<B>,
    conv3: Conv2d<B>,
    bn3: BatchNorm<B>,
    shortcut: Option<Projection<B>>,
}

impl<B: ModelBackend> Bottleneck<B> {
    /// `width` is the 3x3 convolution's channel count; the block outputs `4 * width`.
    pub fn new(cin: usize, width: usize, stride: usize, device: &B::Device) -> Self {
        let cout = width * 4;
        Bottleneck {
            conv1: conv(cin, width, 1, 1, device),
            bn1: bn(width, device),
            conv2: conv(width, width, 3, stride, device),
            bn2: bn(width, device),
            conv3: conv(width, cout, 1, 1, device),
            bn3: bn(cout, device),
            shortcut: shortcut(cin, cout, stride, device),
        }
    }

    /// `[B, cin, H, W] -> [B, 4 * width, H / stride, W / stride]`
    pub fn forward(&self, x: Tensor<B, 4>, c: Compute) -> Tensor<B, 4> {
        let identity = match &self.shortcut {
            Some(s) => s.forward(x.clone(), c),
            None => x.clone(),
        };
        let y = batch_norm_relu(&self.bn1, precision::conv(&self.conv1, x, c), c.layout);
        let y = batch_norm_relu(&self.bn2, precision::conv(&self.conv2, y, c), c.layout);
        let y = precision::conv(&self.conv3, y, c);
        batch_norm_add_relu(&self.bn3, y, identity, c.layout)
    }
}

/// Either kind of block, chosen at run time by the flavor. (Blocks are built once;
/// the size difference between the variants costs nothing.)
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Block<B: Backend> {
    Basic(Basic<B>),
    Bottleneck(Bottleneck<B>),
}

impl<B: ModelBackend> Block<B> {
    pub fn forward(&self, x: Tensor<B, 4>, c: Compute) -> Tensor<B, 4> {
        match self {
            Block::Basic(b) => b.forward(x, c),
            Block::Bottleneck(b) => b.forward(x, c),
        }
    }
}
