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
