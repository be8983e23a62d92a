//! The backend and device unit tests run on: the CPU, with autodiff.

use burn::backend::Autodiff;
use burn::backend::flex::{Flex, FlexDevice};

pub type TestBackend = Autodiff<Flex>;

pub fn device() -> FlexDevice {
    FlexDevice
}

/// Flex keeps one random generator per process, seeded by `Backend::seed`. Tests that
/// draw from it (initialising a model, `Tensor::random`) hold this lock, so a test that
/// checks reproducibility is not disturbed by draws of tests running beside it.
pub fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh directory under the system temp dir, removed when dropped.
///
/// (Not the `tempfile` crate: as a dev-dependency it turns on features of crates Burn
/// depends on, so `cargo test` and `cargo build` would each compile Burn.)
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn tempdir() -> TempDir {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kiln-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the temp dir should be writable");
    TempDir(dir)
}

/// Every float parameter and buffer of `m`, flattened in visiting order.
pub fn floats<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(m: &M) -> Vec<f32> {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Collect(Vec<f32>);
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0
                .extend(p.val().into_data().to_vec::<f32>().expect("f32 tensors"));
        }
    }
    let mut c = Collect(Vec::new());
    m.visit(&mut c);
    c.0
}

/// The largest element-wise difference of two equally long vectors.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// [`max_diff`] relative to the reference `b`'s largest magnitude (at least 1e-6).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    max_diff(a, b) / b.iter().fold(1e-6f32, |m, v| m.max(v.abs()))
}

/// One epoch of three batches of 8 synthetic 8x8 images of 3 classes, as loaded for
/// training: small enough to train a ResNet on the CPU in a test.
pub fn tiny_batches() -> Vec<crate::data::Batch> {
    use crate::config::{Config, DatasetKind};
    let mut cfg = Config::default();
    cfg.data.dataset = DatasetKind::Synthetic;
    cfg.data.image_size = 8;
    cfg.data.synthetic_classes = 3;
    cfg.data.synthetic_train_size = 24;
    let data = crate::data::open(&cfg.data, 0).expect("synthetic data opens");
    let (train, _) = data.loaders(&cfg.data, 8, 0);
    train.epoch(0, 0).map(Result::unwrap).collect()
}

/// A loss that weighs every element of `t` by its flat index over the element count, so
/// a transposed or misplaced gradient cannot pass. Summed in f32, so half-precision
/// outputs are compared on the same scale.
pub fn weighed_sum<B: burn::tensor::backend::Backend, const D: usize>(
    t: burn::tensor::Tensor<B, D>,
) -> burn::tensor::Tensor<B, 1> {
    use burn::tensor::{FloatDType, Int, Tensor};
    let n = t.shape().num_elements() as i64;
    let weights = Tensor::<B, 1, Int>::arange(0..n, &t.device())
        .float()
        .reshape(t.shape())
        .div_scalar(n as f64);
    (t.cast(FloatDType::F32) * weights).sum()
}
