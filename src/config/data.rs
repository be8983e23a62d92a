//! `[data]`: what to read and how to feed it.

use serde::{Deserialize, Serialize};

use super::error::{ConfigError, at_most};

/// Which dataset reader to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    /// Fashion-MNIST IDX files (gzip or raw), 28x28 grey, 10 classes.
    FashionMnist,
    /// MNIST digits in the same IDX format (no horizontal flips: digits are not symmetric).
    Mnist,
    /// The CIFAR-10 binary archive (`cifar-10-batches-bin/`), 32x32 RGB, 10 classes.
    Cifar10,
    /// `ROOT/{train,test}/CLASS/*.{png,jpg}`; classes are the sub-folder names, sorted.
    ImageFolder,
    /// Random images with learnable class-dependent means, for benchmarks and tests.
    Synthetic,
}

impl DatasetKind {
    /// Where `data.root = ""` points, relative to the working directory.
    pub fn default_root(self) -> &'static str {
        match self {
            DatasetKind::FashionMnist => "datasets/fashion-mnist",
            DatasetKind::Mnist => "datasets/mnist",
            DatasetKind::Cifar10 => "datasets/cifar-10-batches-bin",
            DatasetKind::ImageFolder => "datasets/images",
            DatasetKind::Synthetic => "",
        }
    }
}

/// Horizontal flips during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flip {
    /// On for natural images and clothes, off for MNIST digits.
    Auto,
    On,
    Off,
}

/// `[data]`: what to read and how to feed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub dataset: DatasetKind,
    /// Dataset location. Empty: the dataset's usual place under `datasets/` (for
    /// `cifar10`, a folder holding `data_batch_1.bin`..`test_batch.bin` or its parent).
    /// Relative paths are taken from the working directory; the run dir records the
    /// absolute path.
    pub root: String,
    /// Side of the square images fed to the network, in pixels. 0: the dataset's own
    /// size (image folders: the size of the first image). Other sizes are resized.
    pub image_size: u32,
    /// Random crop after zero-padding each side by this many pixels (train only). 0: off.
    pub crop_padding: u32,
    /// Random horizontal flips (train only).
    pub hflip: Flip,
    /// Use at most this many training images (the first ones). 0: all.
    pub max_train_samples: usize,
    /// Use at most this many test images. 0: all.
    pub max_test_samples: usize,
    /// Threads that decode, augment and batch, off the training thread. At least 1.
    pub num_workers: usize,
    /// Batches prepared ahead of the training thread. At least 1.
    pub prefetch: usize,
    /// CUDA: each batch is copied into a page-locked host buffer (from a pool that is
    /// reused) and uploaded from there on kiln's own stream, so the copy engine reads
    /// it while cubecl's device thread goes on launching kernels; `false`: cubecl's
    /// pageable upload. No effect on the CPU, where nothing is uploaded.
    pub pin_memory: bool,
    /// `synthetic` only: number of training images.
    pub synthetic_train_size: usize,
    /// `synthetic` only: number of test images.
    pub synthetic_test_size: usize,
    /// `synthetic` only: number of classes.
    pub synthetic_classes: usize,
    /// `synthetic` only: channels per image.
    pub synthetic_channels: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::FashionMnist,
            root: String::new(),
            image_size: 0,
            crop_padding: 4,
            hflip: Flip::Auto,
            max_train_samples: 0,
            max_test_samples: 0,
            num_workers: 4,
            prefetch: 4,
            pin_memory: true,
            synthetic_train_size: 10_240,
            synthetic_test_size: 1_024,
            synthetic_classes: 10,
            synthetic_channels: 3,
        }
    }
}

/// Loader threads at most: more than any machine has cores.
pub const MAX_WORKERS: usize = 256;
/// Batches prepared ahead at most: each is a whole batch in host memory.
pub const MAX_PREFETCH: usize = 256;
/// Synthetic images per split at most (each is made on demand, but the loader keeps an
/// index of every image).
pub const MAX_SYNTHETIC_IMAGES: usize = 10_000_000;

impl DataConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_workers == 0 {
            return Err(ConfigError::invalid(
                "data.num_workers",
                0,
                "at least 1 (loading always runs off the training thread)",
            ));
        }
        at_most(
            "data.num_workers",
            self.num_workers as u64,
            MAX_WORKERS as u64,
            "loader threads",
        )?;
        if self.prefetch == 0 {
            return Err(ConfigError::invalid("data.prefetch", 0, "at least 1"));
        }
        at_most(
            "data.prefetch",
            self.prefetch as u64,
            MAX_PREFETCH as u64,
            "batches held ahead in host memory",
        )?;
        if self.image_size > 4096 {
            return Err(ConfigError::invalid(
                "data.image_size",
                self.image_size,
                "0 (the dataset's size) or at most 4096",
            ));
        }
        at_most(
            "data.crop_padding",
            self.crop_padding as u64,
            1024,
            "pixels of padding on each side",
        )?;
        if self.dataset == DatasetKind::Synthetic {
            if self.synthetic_classes < 2 {
                return Err(ConfigError::invalid(
                    "data.synthetic_classes",
                    self.synthetic_classes,
                    "at least 2",
                ));
            }
            at_most(
                "data.synthetic_classes",
                self.synthetic_classes as u64,
                100_000,
                "classes of the classifier's output",
            )?;
            if self.synthetic_channels == 0 || self.synthetic_channels > 4 {
                return Err(ConfigError::invalid(
                    "data.synthetic_channels",
                    self.synthetic_channels,
                    "1 to 4",
                ));
            }
            if self.synthetic_train_size == 0 || self.synthetic_test_size == 0 {
                return Err(ConfigError::invalid(
                    "data.synthetic_train_size",
                    format!(
                        "{} / {}",
                        self.synthetic_train_size, self.synthetic_test_size
                    ),
                    "at least 1 image in each split (data.synthetic_test_size too)",
                ));
            }
            for (key, n) in [
                ("data.synthetic_train_size", self.synthetic_train_size),
                ("data.synthetic_test_size", self.synthetic_test_size),
            ] {
                at_most(
                    key,
                    n as u64,
                    MAX_SYNTHETIC_IMAGES as u64,
                    "images per split: the loader keeps the order of every image in memory",
                )?;
            }
        }
        Ok(())
    }
}
