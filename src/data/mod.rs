//! Datasets: readers for IDX, CIFAR-10 binary, image folders and synthetic images, the
//! per-image transforms, and the threaded loader. No Burn here: batches are host
//! memory, turned into tensors by the trainer.

mod cifar;
mod error;
mod idx;
mod image_folder;
mod loader;
mod source;
mod synthetic;
mod transform;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use error::DataError;
pub use image_folder::is_image_file;
pub use loader::{Batch, Loader};
pub use source::{Shape, Source};
pub use transform::{Augment, Normalization};

use crate::config::{DataConfig, DatasetKind, Flip};
use source::InMemory;

/// Both splits of a dataset, ready to be batched.
pub struct Dataset {
    /// Absolute location (empty for synthetic data).
    pub root: PathBuf,
    pub classes: Vec<String>,
    pub train: Arc<dyn Source>,
    pub test: Arc<dyn Source>,
    pub norm: Normalization,
    /// Whether `hflip = "auto"` flips: yes for natural images and clothes, no for digits.
    flips_naturally: bool,
}

impl Dataset {
    pub fn shape(&self) -> Shape {
        self.train.shape()
    }

    /// Reads every image of both splits once, on every core, so a bad file stops the
    /// run before training instead of at the first evaluation. Files checked before
    /// (same path, size and modification time) are remembered in `cache` and skipped.
    /// Returns how many images were checked now.
    pub fn check(&self, cache: &std::path::Path) -> Result<usize, DataError> {
        use std::collections::HashSet;
        let known: HashSet<String> = std::fs::read_to_string(cache)
            .map(|t| t.lines().map(str::to_string).collect())
            .unwrap_or_default();
        let mut checked = Vec::new();
        let result = self
            .train
            .check(&known, &mut checked)
            .and(self.test.check(&known, &mut checked));
        // The good ones are remembered even when one is bad: once it is fixed, only it
        // is read again.
        if !checked.is_empty() {
            let mut all: Vec<&String> = known.iter().chain(&checked).collect();
            all.sort();
            all.dedup();
            let text: String = all.iter().map(|k| format!("{k}\n")).collect();
            // A cache that cannot be written only costs the next run a check.
            if let Some(dir) = cache.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let tmp = cache.with_extension("tmp");
            if std::fs::write(&tmp, text).is_ok() {
                let _ = std::fs::rename(&tmp, cache);
            }
        }
        result.map(|()| checked.len())
    }

    pub fn augment(&self, cfg: &DataConfig) -> Augment {
        Augment {
            crop_padding: cfg.crop_padding as usize,
            hflip: match cfg.hflip {
                Flip::Auto => self.flips_naturally,
                Flip::On => true,
                Flip::Off => false,
            },
        }
    }

    /// The training loader (shuffled, augmented, last partial batch dropped) and the
    /// test loader (in order, every image). `batch_size` is per step, host side.
    pub fn loaders(&self, cfg: &DataConfig, batch_size: usize, seed: u64) -> (Loader, Loader) {
        let norm = Arc::new(self.norm.clone());
        let train = Loader::new(
            self.train.clone(),
            norm.clone(),
            Some(self.augment(cfg)),
            batch_size,
            true,
            seed,
            cfg.num_workers,
            cfg.prefetch,
        );
        (train, self.eval_loader(cfg, false, batch_size))
    }

    /// Every image of a split, in order, without augmentation.
    pub fn eval_loader(&self, cfg: &DataConfig, train_split: bool, batch_size: usize) -> Loader {
        let source = if train_split {
            self.train.clone()
        } else {
            self.test.clone()
        };
        Loader::new(
            source,
            Arc::new(self.norm.clone()),
            None,
            batch_size,
            false,
            0,
            cfg.num_workers,
            cfg.prefetch,
        )
    }
}

/// What a network trained on a dataset takes: the image shape and the normalisation
/// its pixels had. Recorded with every checkpoint, so a run's model can classify new
/// images (`kiln predict`) and be exported without the dataset at hand.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InputSpec {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub norm: Normalization,
}

impl Dataset {
    pub fn input(&self) -> InputSpec {
        let shape = self.train.shape();
        InputSpec {
            channels: shape.channels,
            height: shape.height,
            width: shape.width,
            norm: self.norm.clone(),
        }
    }
}

/// Every image in `files` (labels all 0), in order, decoded to `input`'s shape and
/// normalised as the network's training images were: what `kiln predict` classifies.
pub fn file_loader(
    files: Vec<PathBuf>,
    input: &InputSpec,
    batch_size: usize,
    workers: usize,
) -> Loader {
    let shape = source::Shape {
        channels: input.channels,
        height: input.height,
        width: input.width,
    };
    let source = image_folder::ImageFolder::from_files(files, shape);
    Loader::new(
        Arc::new(source),
        Arc::new(input.norm.clone()),
        None,
        batch_size,
        false,
        0,
        workers,
        2,
    )
}

/// `data.root` made absolute: empty means the dataset's usual place.
pub fn resolve_root(cfg: &DataConfig) -> PathBuf {
    let raw = if cfg.root.is_empty() {
        cfg.dataset.default_root()
    } else {
        cfg.root.as_str()
    };
    let path = Path::new(raw);
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    };
    abs.canonicalize().unwrap_or(abs)
}

/// Opens the dataset `cfg` describes; every file problem is reported here, before training.
pub fn open(cfg: &DataConfig, seed: u64) -> Result<Dataset, DataError> {
    let root = resolve_root(cfg);
    let side = cfg.image_size as usize;
    let mnist_like =
        |classes: Vec<String>, norm: (f32, f32), flips: bool| -> Result<Dataset, DataError> {
            if !root.is_dir() {
                return Err(DataError::Missing {
                    path: root.clone(),
                    reason: "no such folder (set data.root)".into(),
                });
            }
            let train = idx::read_split(&root, "train", classes.len())?
                .truncate(cfg.max_train_samples)
                .resized(side);
            let test = idx::read_split(&root, "t10k", classes.len())?
                .truncate(cfg.max_test_samples)
                .resized(side);
            Ok(Dataset {
                root: root.clone(),
                classes,
                train: Arc::new(train),
                test: Arc::new(test),
                norm: Normalization {
                    mean: vec![norm.0],
                    std: vec![norm.1],
                },
                flips_naturally: flips,
            })
        };
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    match cfg.dataset {
        DatasetKind::FashionMnist => mnist_like(
            names(&[
                "t-shirt/top",
                "trouser",
                "pullover",
                "dress",
                "coat",
                "sandal",
                "shirt",
                "sneaker",
                "bag",
                "ankle boot",
            ]),
            (0.2860, 0.3530),
            true,
        ),
        DatasetKind::Mnist => mnist_like(
            (0..10).map(|d| d.to_string()).collect(),
            (0.1307, 0.3081),
            false,
        ),
        DatasetKind::Cifar10 => {
            let dir = cifar::locate(&root)?;
            let train: InMemory = cifar::read_train(&dir)?
                .truncate(cfg.max_train_samples)
                .resized(side);
            let test = cifar::read_test(&dir)?
                .truncate(cfg.max_test_samples)
                .resized(side);
            Ok(Dataset {
                root: dir.clone(),
                classes: cifar::classes(&dir),
                train: Arc::new(train),
                test: Arc::new(test),
                norm: Normalization {
                    mean: vec![0.4914, 0.4822, 0.4465],
                    std: vec![0.2470, 0.2435, 0.2616],
                },
                flips_naturally: true,
            })
        }
        DatasetKind::ImageFolder => {
            let classes = image_folder::classes(&root)?;
            let train = image_folder::ImageFolder::open(
                &root,
                "train",
                &classes,
                side,
                cfg.max_train_samples,
            )?;
            let shape = train.shape();
            let test = image_folder::ImageFolder::open(
                &root,
                "test",
                &classes,
                shape.height,
                cfg.max_test_samples,
            )?;
            if test.shape() != shape {
                return Err(DataError::malformed(
                    root.join("test"),
                    format!(
                        "test images have {} channel(s), training images {}; convert one split",
                        test.shape().channels,
                        shape.channels
                    ),
                ));
            }
            let norm = folder_stats(&train)?;
            Ok(Dataset {
                root,
                classes,
                train: Arc::new(train),
                test: Arc::new(test),
                norm,
                flips_naturally: true,
            })
        }
        DatasetKind::Synthetic => {
            let side = if side == 0 { 32 } else { side };
            let shape = Shape {
                channels: cfg.synthetic_channels,
                height: side,
                width: side,
            };
            let n = cfg.synthetic_classes;
            let limit = |len: usize, max: usize| if max > 0 { len.min(max) } else { len };
            Ok(Dataset {
                root: PathBuf::new(),
                classes: (0..n).map(|c| format!("class{c}")).collect(),
                train: Arc::new(synthetic::Synthetic::new(
                    shape,
                    limit(cfg.synthetic_train_size, cfg.max_train_samples),
                    n,
                    seed,
                    0,
                )),
                test: Arc::new(synthetic::Synthetic::new(
                    shape,
                    limit(cfg.synthetic_test_size, cfg.max_test_samples),
                    n,
                    seed,
                    1,
                )),
                norm: Normalization {
                    mean: vec![0.5; shape.channels],
                    std: vec![0.25; shape.channels],
                },
                flips_naturally: true,
            })
        }
    }
}

/// Normalisation statistics of an image folder, from up to 512 evenly spread training images.
fn folder_stats(train: &image_folder::ImageFolder) -> Result<Normalization, DataError> {
    use rayon::prelude::*;
    let n = train.len().min(512);
    let step = train.len() / n;
    let images: Vec<Vec<u8>> = (0..n)
        .into_par_iter()
        .map(|i| {
            let mut px = vec![0; train.shape().len()];
            train.read(i * step, &mut px).map(|_| px)
        })
        .collect::<Result<_, _>>()?;
    Ok(transform::measure(&images, train.shape()))
}
