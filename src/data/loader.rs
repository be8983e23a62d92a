//! Batches for the training thread, made on worker threads.
//!
//! The order of an epoch and every augmentation draw are pure functions of
//! (seed, epoch, image index), so the batches do not depend on the number of
//! workers or on timing, and an epoch can be resumed at any batch. Worker `w` makes
//! batches `w, w + W, w + 2W, ...` into its own bounded channel and the consumer reads
//! the channels round-robin: batches arrive in order, at most `prefetch` ahead.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::DataError;
use super::source::Source;
use super::transform::{Augment, Normalization, prepare};

/// One batch in host memory: `images` is `[n, c, h, w]` f32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub images: Vec<f32>,
    pub labels: Vec<i64>,
    pub shape: [usize; 4],
}

impl Batch {
    /// Consecutive pieces of `sizes[i]` images each (`sizes` must sum to the batch size).
    pub fn split(self, sizes: &[usize]) -> Vec<Batch> {
        let [n, c, h, w] = self.shape;
        assert_eq!(
            sizes.iter().sum::<usize>(),
            n,
            "shard sizes must cover the batch"
        );
        let per = c * h * w;
        let Some((&first, rest)) = sizes.split_first() else {
            return Vec::new();
        };
        // The first shard keeps the batch's own buffers (truncated, no copy); the
        // others are copied out of them first. One shard: nothing is copied.
        let mut others = Vec::with_capacity(rest.len());
        let mut lo = first;
        for &k in rest {
            others.push(Batch {
                images: self.images[lo * per..(lo + k) * per].to_vec(),
                labels: self.labels[lo..lo + k].to_vec(),
                shape: [k, c, h, w],
            });
            lo += k;
        }
        let (mut images, mut labels) = (self.images, self.labels);
        images.truncate(first * per);
        labels.truncate(first);
        let mut out = Vec::with_capacity(sizes.len());
        out.push(Batch {
            images,
            labels,
            shape: [first, c, h, w],
        });
        out.extend(others);
        out
    }
}

#[derive(Clone)]
pub struct Loader {
    source: Arc<dyn Source>,
    norm: Arc<Normalization>,
    augment: Option<Augment>,
    batch_size: usize,
    /// Train: shuffle each epoch and drop the last partial batch. Test: neither.
    train: bool,
    seed: u64,
    workers: usize,
    prefetch: usize,
    /// `(part, parts)`: only this part of every batch is made (one process's shard of
    /// a multi-process run); `(0, 1)` makes whole batches.
    shard: (usize, usize),
}

/// Images `start..end` of a batch of `n` cut into `parts` consecutive shards: equal,
/// the first `n % parts` one image larger, the same cut as the single-process
/// learner's `shard_sizes` with equal weights.
pub fn shard_range(n: usize, part: usize, parts: usize) -> (usize, usize) {
    let (base, extra) = (n / parts, n % parts);
    let start = part * base + part.min(extra);
    (start, start + base + usize::from(part < extra))
}

impl Loader {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        source: Arc<dyn Source>,
        norm: Arc<Normalization>,
        augment: Option<Augment>,
        batch_size: usize,
        train: bool,
        seed: u64,
        workers: usize,
        prefetch: usize,
    ) -> Self {
        Loader {
            source,
            norm,
            augment,
            batch_size,
            train,
            seed,
            workers: workers.max(1),
            prefetch: prefetch.max(1),
            shard: (0, 1),
        }
    }

    /// The same loader making only shard `part` of `parts` of every batch; the order,
    /// the batches and every augmentation stay those of the whole loader.
    pub fn sharded(mut self, part: usize, parts: usize) -> Self {
        assert!(part < parts, "a shard of the batch");
        self.shard = (part, parts);
        self
    }

    pub fn num_images(&self) -> usize {
        self.source.len()
    }

    pub fn batches_per_epoch(&self) -> usize {
        if self.train {
            self.source.len() / self.batch_size
        } else {
            self.source.len().div_ceil(self.batch_size)
        }
    }

    /// Image indices of `epoch`, in the order they are batched.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.source.len()).collect();
        if self.train {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(mix(
                self.seed,
                epoch,
                u64::MAX,
            )));
        }
        order
    }

    /// Batches `start..` of `epoch`, made by the worker threads.
    pub fn epoch(&self, epoch: u64, start: usize) -> Epoch {
        let order = Arc::new(self.order(epoch));
        let total = self.batches_per_epoch();
        let start = start.min(total);
        let per_worker = self.prefetch.div_ceil(self.workers).max(1);
        let mut receivers = Vec::with_capacity(self.workers);
        let mut handles = Vec::with_capacity(self.workers);
        for w in 0..self.workers {
            let (tx, rx) = sync_channel(per_worker);
            receivers.push(rx);
            let job = self.clone();
            let order = order.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kiln-loader-{w}"))
                .spawn(move || job.work(epoch, &order, start + w, total, tx))
                .expect("spawning a loader thread should succeed");
            handles.push(handle);
        }
        Epoch {
            receivers,
            next: start,
            end: total,
            start,
            _handles: handles,
        }
    }

    fn work(
        &self,
        epoch: u64,
        order: &[usize],
        first: usize,
        end: usize,
        tx: SyncSender<Result<Batch, DataError>>,
    ) {
        let mut k = first;
        while k < end {
            let batch = self.make(epoch, order, k);
            let failed = batch.is_err();
            if tx.send(batch).is_err() || failed {
                return; // consumer gone, or it will stop at this error
            }
            k += self.workers;
        }
    }

    /// Batch `k` of `epoch`.
    pub fn make(&self, epoch: u64, order: &[usize], k: usize) -> Result<Batch, DataError> {
        let shape = self.source.shape();
        let lo = k * self.batch_size;
        let hi = (lo + self.batch_size).min(order.len());
        let (from, to) = shard_range(hi - lo, self.shard.0, self.shard.1);
        let (lo, hi) = (lo + from, lo + to);
        let n = hi - lo;
        let mut images = vec![0f32; n * shape.len()];
        let mut labels = Vec::with_capacity(n);
        let mut pixels = vec![0u8; shape.len()];
        for (slot, &index) in order[lo..hi].iter().enumerate() {
            self.source.read(index, &mut pixels)?;
            let out = &mut images[slot * shape.len()..(slot + 1) * shape.len()];
            match &self.augment {
                Some(aug) => {
                    let mut rng = ChaCha8Rng::seed_from_u64(mix(self.seed, epoch, index as u64));
                    prepare(&pixels, shape, &self.norm, Some((aug, &mut rng)), out);
                }
                None => prepare(
                    &pixels,
                    shape,
                    &self.norm,
                    None::<(&Augment, &mut ChaCha8Rng)>,
                    out,
                ),
            }
            labels.push(self.source.label(index) as i64);
        }
        Ok(Batch {
            images,
            labels,
            shape: [n, shape.channels, shape.height, shape.width],
        })
    }
}

/// One seed per (run seed, epoch, image): independent streams without shared state.
fn mix(seed: u64, epoch: u64, index: u64) -> u64 {
    let mut h = seed ^ 0x6a09_e667_f3bc_c908;
    for v in [epoch, index] {
        h = (h ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
    }
    h
}

/// The batches of one epoch, in order.
pub struct Epoch {
    receivers: Vec<Receiver<Result<Batch, DataError>>>,
    next: usize,
    start: usize,
    end: usize,
    _handles: Vec<JoinHandle<()>>,
}

impl Iterator for Epoch {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let w = (self.next - self.start) % self.receivers.len();
        self.next += 1;
        // A worker only hangs up early after sending an error, which was returned.
        self.receivers[w].recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::source::{InMemory, Shape};

    fn source(n: usize) -> Arc<dyn Source> {
        let shape = Shape {
            channels: 1,
            height: 2,
            width: 2,
        };
        Arc::new(InMemory {
            shape,
            pixels: (0..n * 4).map(|i| (i % 251) as u8).collect(),
            labels: (0..n).map(|i| (i % 10) as u16).collect(),
        })
    }

    fn loader(n: usize, workers: usize, train: bool) -> Loader {
        let norm = Arc::new(Normalization {
            mean: vec![0.0],
            std: vec![1.0],
        });
        let aug = Augment {
            crop_padding: 1,
            hflip: true,
        };
        Loader::new(
            source(n),
            norm,
            train.then_some(aug),
            4,
            train,
            7,
            workers,
            2,
        )
    }

    #[test]
    fn batches_do_not_depend_on_the_number_of_workers() {
        let one: Vec<Batch> = loader(37, 1, true)
            .epoch(3, 0)
            .map(Result::unwrap)
            .collect();
        let five: Vec<Batch> = loader(37, 5, true)
            .epoch(3, 0)
            .map(Result::unwrap)
            .collect();
        assert_eq!(one.len(), 9, "train drops the last partial batch");
        assert_eq!(one, five);
    }

    #[test]
    fn the_shards_of_a_batch_put_together_are_the_whole_batch() {
        // Batch size 4 over 3 processes: shards of 2, 1 and 1 images.
        assert_eq!(
            (0..3).map(|p| shard_range(4, p, 3)).collect::<Vec<_>>(),
            vec![(0, 2), (2, 3), (3, 4)]
        );
        assert_eq!(shard_range(1, 1, 2), (1, 1), "a shard may be empty");
        for train in [true, false] {
            let whole: Vec<Batch> = loader(37, 2, train)
                .epoch(2, 0)
                .map(Result::unwrap)
                .collect();
            let shards: Vec<Vec<Batch>> = (0..3)
                .map(|p| {
                    loader(37, 2, train)
                        .sharded(p, 3)
                        .epoch(2, 0)
                        .map(Result::unwrap)
                        .collect()
                })
                .collect();
            for (k, b) in whole.iter().enumerate() {
                let parts: Vec<Batch> = shards.iter().map(|s| s[k].clone()).collect();
                let [_, c, h, w] = b.shape;
                let joined = Batch {
                    images: parts.iter().flat_map(|p| p.images.clone()).collect(),
                    labels: parts.iter().flat_map(|p| p.labels.clone()).collect(),
                    shape: [parts.iter().map(|p| p.labels.len()).sum(), c, h, w],
                };
                assert_eq!(&joined, b, "batch {k} (train: {train})");
            }
        }
    }

    #[test]
    fn resuming_at_a_batch_gives_the_remaining_batches() {
        let l = loader(37, 3, true);
        let all: Vec<Batch> = l.epoch(1, 0).map(Result::unwrap).collect();
        let tail: Vec<Batch> = l.epoch(1, 5).map(Result::unwrap).collect();
        assert_eq!(&all[5..], &tail[..]);
    }

    #[test]
    fn epochs_are_shuffled_differently_and_test_is_not_shuffled() {
        let l = loader(37, 2, true);
        assert_ne!(l.order(0), l.order(1));
        let t = loader(10, 2, false);
        assert_eq!(t.order(0), (0..10).collect::<Vec<_>>());
        let batches: Vec<Batch> = t.epoch(0, 0).map(Result::unwrap).collect();
        assert_eq!(
            batches.iter().map(|b| b.labels.len()).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        assert_eq!(batches[2].labels, vec![8, 9]);
    }

    #[test]
    fn dropping_an_epoch_early_stops_the_workers() {
        let l = loader(400, 4, true);
        let mut e = l.epoch(0, 0);
        assert!(e.next().is_some());
        drop(e); // must not hang
    }
}
