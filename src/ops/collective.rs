//! [`CollectiveBackend`]: a device buffer summed (or broadcast) across the devices of a
//! run on the devices themselves, as NCCL does on CUDA, queued in order with the
//! device's other work. A backend without device collectives (the CPU) makes no
//! communicator; its runs exchange through host memory instead (`train::exchange`).

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

/// One device's membership of a group of devices that run collectives together.
pub trait DeviceComm: Send + Sync + std::fmt::Debug {
    /// This device's place in the group, 0-based.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Ends the collectives in flight and makes later ones fail: what the watchdog and
    /// a failed peer's thread call, from any thread, so no device waits forever.
    fn abort(&self);
    /// The first error one of this communicator's collectives met, if any (they run
    /// where errors cannot be handed back to their caller).
    fn error(&self) -> Option<String>;
    /// The implementation behind the trait, for the backend that made it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A communicator, shared by the operations that use it.
pub type Comm = Arc<dyn DeviceComm>;

fn none() -> String {
    "this backend has no device collectives; its devices exchange through host memory \
     (parallel.exchange = \"host\")"
        .into()
}

pub trait CollectiveBackend: Backend {
    /// `None` where the backend has no device collectives (the CPU); otherwise the
    /// library's version, or why it cannot be used here.
    fn device_collectives() -> Option<Result<String, String>> {
        None
    }

    /// One communicator per device of `devices` (in that order, rank = position), all
    /// made by this thread: for threads of one process, each driving one device.
    fn communicators(devices: &[Self::Device]) -> Result<Vec<Comm>, String> {
        let _ = devices;
        Err(none())
    }

    /// A fresh id for a group of processes: rank 0 makes it and hands it to the others.
    fn new_group_id() -> Result<Vec<u8>, String> {
        Err(none())
    }

    /// This process's communicator in the group `id` names, of `size` processes:
    /// waits until every rank has joined.
    fn join_group(
        device: &Self::Device,
        id: &[u8],
        rank: usize,
        size: usize,
    ) -> Result<Comm, String> {
        let _ = (device, id, rank, size);
        Err(none())
    }

    /// `x` summed element-wise over every member of `comm`, in `x`'s dtype. A failure
    /// shows in `comm.error()`.
    fn all_reduce_sum(x: FloatTensor<Self>, comm: &Comm) -> FloatTensor<Self> {
        let _ = (x, comm);
        unreachable!("a communicator exists only on backends with device collectives")
    }

    /// Each of `xs` summed element-wise over every member of `comm`, all through one
    /// buffer and one collective: the inputs are copied into it, the results keep
    /// their shapes (on CUDA, views into the buffer). All of one float dtype.
    fn all_reduce_many(xs: Vec<FloatTensor<Self>>, comm: &Comm) -> Vec<FloatTensor<Self>> {
        let _ = (xs, comm);
        unreachable!("a communicator exists only on backends with device collectives")
    }

    /// Rank `root`'s `x` on every member of `comm`.
    fn broadcast(x: FloatTensor<Self>, comm: &Comm, root: usize) -> FloatTensor<Self> {
        let _ = (x, comm, root);
        unreachable!("a communicator exists only on backends with device collectives")
    }

    /// Hands every operation this thread queued for `device` to the device (without
    /// waiting for it to run): a collective left queued on one device while its peers
    /// wait in theirs would wait forever.
    fn flush(device: &Self::Device) {
        let _ = device;
    }
}

impl CollectiveBackend for Flex {}

/// Collectives run on the inner backend's tensors; an autodiff backend has the trait
/// only to be a `ModelBackend`.
impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {}
