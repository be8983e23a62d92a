//! The dataset abstraction every reader produces: a split is a random-access list of
//! fixed-size u8 images (channels, height, width) with a class label each.

use super::DataError;

/// Image geometry shared by every image of a split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

impl Shape {
    pub fn len(&self) -> usize {
        self.channels * self.height * self.width
    }
}

/// One split (train or test). `read` may decode a file, so it can fail; it is called
/// from loader worker threads.
pub trait Source: Send + Sync {
    fn len(&self) -> usize;
    fn shape(&self) -> Shape;
    fn label(&self, index: usize) -> usize;
    /// Writes image `index` as CHW u8 into `out` (`out.len() == shape().len()`).
    fn read(&self, index: usize, out: &mut [u8]) -> Result<(), DataError>;
    /// Makes sure every image can be read, so that a bad file is found before training
    /// rather than in the middle of it. `known` names the files checked before (see
    /// `Dataset::check`); those found good now are added to `good`, also when another
    /// one fails. Sources read whole when opened have nothing left to check.
    fn check(
        &self,
        known: &std::collections::HashSet<String>,
        good: &mut Vec<String>,
    ) -> Result<(), DataError> {
        let _ = (known, good);
        Ok(())
    }
}

/// Images decoded up front and kept in memory (IDX, CIFAR-10 binary).
pub struct InMemory {
    pub shape: Shape,
    pub pixels: Vec<u8>,
    pub labels: Vec<u16>,
}

impl std::fmt::Debug for InMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "InMemory({} images of {:?})",
            self.labels.len(),
            self.shape
        )
    }
}

impl InMemory {
    /// Keeps the first `n` images (all when `n` is 0 or larger than the split).
    pub fn truncate(mut self, n: usize) -> Self {
        if n > 0 && n < self.labels.len() {
            self.labels.truncate(n);
            self.pixels.truncate(n * self.shape.len());
        }
        self
    }

    /// Resizes every image to `side` x `side` (bilinear), when it is not that size already.
    pub fn resized(self, side: usize) -> Self {
        if side == 0 || (self.shape.height == side && self.shape.width == side) {
            return self;
        }
        let from = self.shape;
        let to = Shape {
            channels: from.channels,
            height: side,
            width: side,
        };
        let mut pixels = vec![0u8; self.labels.len() * to.len()];
        use rayon::prelude::*;
        pixels
            .par_chunks_mut(to.len())
            .zip(self.pixels.par_chunks(from.len()))
            .for_each(|(dst, src)| super::transform::resize_chw(src, from, dst, to));
        InMemory {
            shape: to,
            pixels,
            labels: self.labels,
        }
    }
}

impl Source for InMemory {
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn shape(&self) -> Shape {
        self.shape
    }
    fn label(&self, index: usize) -> usize {
        self.labels[index] as usize
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<(), DataError> {
        let n = self.shape.len();
        out.copy_from_slice(&self.pixels[index * n..(index + 1) * n]);
        Ok(())
    }
}
