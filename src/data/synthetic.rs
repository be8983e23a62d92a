//! Synthetic images for benchmarks and tests: each class has its own mean colour and
//! a class-dependent gradient, plus noise, so a network can learn it. Images are made
//! on demand from (seed, split, index), so any size costs no memory.

use super::DataError;
use super::source::{Shape, Source};

pub struct Synthetic {
    shape: Shape,
    len: usize,
    classes: usize,
    salt: u64,
}

impl Synthetic {
    pub fn new(shape: Shape, len: usize, classes: usize, seed: u64, split: u64) -> Self {
        Synthetic {
            shape,
            len,
            classes,
            salt: splitmix(seed ^ splitmix(split)),
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Source for Synthetic {
    fn len(&self) -> usize {
        self.len
    }
    fn shape(&self) -> Shape {
        self.shape
    }
    fn label(&self, index: usize) -> usize {
        (splitmix(self.salt ^ index as u64) % self.classes as u64) as usize
    }
    fn read(&self, index: usize, out: &mut [u8]) -> Result<(), DataError> {
        let class = self.label(index) as u64;
        let plane = self.shape.height * self.shape.width;
        let mut state = splitmix(self.salt.wrapping_add(index as u64).wrapping_mul(31));
        for c in 0..self.shape.channels {
            let mean = 48 + (splitmix(class * 8 + c as u64) % 160) as i32;
            let slope = (splitmix(class * 8 + c as u64 + 4) % 64) as i32 - 32;
            for (p, px) in out[c * plane..(c + 1) * plane].iter_mut().enumerate() {
                if p % 8 == 0 {
                    state = splitmix(state);
                }
                let noise = ((state >> ((p % 8) * 8)) & 0xff) as i32 / 4 - 32;
                let y = (p / self.shape.width) as i32 * 64 / self.shape.height as i32 - 32;
                *px = (mean + slope * y / 32 + noise).clamp(0, 255) as u8;
            }
        }
        Ok(())
    }
}
