//! `[model]`: which network to train.

use serde::{Deserialize, Serialize};

/// Which network to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// A 2-block, 8/16-channel ResNet for tests and smoke runs (like torchtitan's debugmodel).
    Tiny,
    /// CIFAR-style ResNets (He et al. 2016, section 4.2): 3 stages of 16/32/64 channels.
    Resnet20,
    Resnet32,
    Resnet56,
    /// ImageNet-style ResNets: 4 stages of 64..512 channels (ResNet-50: bottleneck blocks, x4).
    Resnet18,
    Resnet34,
    Resnet50,
}

/// The first layers of the network, before the residual stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stem {
    /// `small` for images of at most 64 px on their shorter side, else `imagenet`.
    Auto,
    /// 3x3 convolution, stride 1, no max-pool: keeps the resolution of 28-32 px images.
    Small,
    /// 7x7 convolution, stride 2, then a 3x3 max-pool of stride 2: for 224 px images.
    Imagenet,
}

/// `[model]`: the network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Network family member. Input channels and class count come from the dataset.
    pub arch: Arch,
    /// Stem layers; `auto` chooses from the image size.
    pub stem: Stem,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            arch: Arch::Resnet20,
            stem: Stem::Auto,
        }
    }
}
