//! The gradient exchange: how one replica's tensors become the sum over every replica
//! of a run, whether the replicas are threads of one process or processes. One
//! interface ([`Exchange`]: a sum and a broadcast of 1-D buffers), three engines:
//!
//! - `device`: NCCL on the GPUs' own buffers, queued on each device's stream (CUDA);
//! - `host`: threads of one process add their buffers in host memory, in replica order
//!   (the CPU backend, and `parallel.exchange = "host"`);
//! - `tcp`: processes add theirs over TCP through rank 0, in rank order (the CPU).
//!
//! `buckets` turns a model's gradients, weights and BatchNorm statistics into such
//! buffers and back. Every replica weights its loss by its share of the global batch,
//! so the sum of the gradients is the gradient of the global batch's mean loss: there
//! is nothing to divide afterwards.

mod buckets;
mod device;
mod host;
mod tcp;

pub use buckets::{BucketPlan, mean_buffers, share_module, share_trainable, sum_grads};
pub use device::DeviceExchange;
pub use host::HostBoard;
pub use tcp::TcpExchange;

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata};

use super::error::TrainError;
use crate::collective::Group;
use crate::config::Exchange as ExchangeChoice;
use crate::ops::CollectiveBackend;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ExchangeError {
    /// The exchange itself failed (a peer gone, NCCL's error, a timeout).
    #[error("{0}")]
    Failed(String),
    /// Another replica failed and this one's exchange was stopped so it would not
    /// wait for it: the other's error is the one to report.
    #[error("stopped: another replica failed ({0})")]
    Aborted(String),
}

/// Stops a replica's exchange from another thread (the thread that saw a replica
/// fail, or the watchdog), so that nobody waits forever for a peer that will not come.
#[derive(Clone)]
pub struct Aborter(Arc<dyn Fn(&str) + Send + Sync>);

impl Aborter {
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Aborter(Arc::new(f))
    }

    /// An exchange that nothing can block (one replica alone).
    pub fn none() -> Self {
        Aborter::new(|_| {})
    }

    pub fn abort(&self, why: &str) {
        (self.0)(why)
    }
}

/// One replica's end of the exchange. `B` is the backend the buffers live on (the
/// inner backend of training). Every replica calls these in one order, with buffers
/// of the same lengths.
pub trait Exchange<B: Backend>: Send {
    /// This replica's place (0: the main one) and how many there are.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Each buffer summed element-wise over every replica; `during` names the moment
    /// for errors ("step 12").
    fn all_reduce(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError>;
    /// Each bucket's tensors (any shapes, one dtype) summed over every replica, in
    /// their shapes. By default each bucket is joined into one buffer for
    /// [`Exchange::all_reduce`] and cut up again; an engine on the devices does it in one
    /// operation per bucket.
    fn all_reduce_buckets(
        &mut self,
        buckets: Vec<Vec<FloatTensor<B>>>,
        during: &str,
    ) -> Result<Vec<Vec<FloatTensor<B>>>, ExchangeError> {
        let shapes: Vec<Vec<Shape>> = buckets
            .iter()
            .map(|b| b.iter().map(|t| t.shape()).collect())
            .collect();
        let joined = buckets
            .into_iter()
            .map(|b| {
                let flat: Vec<Tensor<B, 1>> = b.into_iter().map(buckets::flat).collect();
                if flat.len() == 1 {
                    flat.into_iter().next().expect("one tensor")
                } else {
                    Tensor::cat(flat, 0)
                }
            })
            .collect();
        let summed = self.all_reduce(joined, during)?;
        Ok(summed
            .into_iter()
            .zip(shapes)
            .map(|(bucket, shapes)| {
                let mut offset = 0;
                shapes
                    .into_iter()
                    .map(|shape| {
                        let n = shape.num_elements();
                        let piece = if offset == 0 && bucket.dims()[0] == n {
                            bucket.clone()
                        } else {
                            bucket.clone().narrow(0, offset, n)
                        };
                        offset += n;
                        B::float_reshape(piece.into_primitive().tensor(), shape)
                    })
                    .collect()
            })
            .collect())
    }

    /// Replica 0's buffers on every replica.
    fn broadcast(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError>;
    /// What stops this exchange from another thread.
    fn aborter(&self) -> Aborter;
    /// The engine, as reports name it ("NCCL 2.27.3", "host memory").
    fn engine(&self) -> String;
    /// Whether a collective holds the calling thread until every replica has come (the
    /// host engines), rather than only queueing work on the device.
    fn waits_for_peers(&self) -> bool {
        true
    }
}

/// Which engine a run's devices exchange through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Engine {
    /// The devices' own collectives (NCCL), with the library's name and version.
    Device(String),
    /// Host memory (threads) or TCP (processes).
    Host,
}

/// The engine `parallel.exchange` asks for, on backend `B`, or why it cannot run.
pub fn engine<B: CollectiveBackend>(asked: ExchangeChoice) -> Result<Engine, String> {
    match (asked, B::device_collectives()) {
        (ExchangeChoice::Host, _) | (ExchangeChoice::Auto, None) => Ok(Engine::Host),
        (_, Some(Ok(version))) => Ok(Engine::Device(version)),
        (ExchangeChoice::Nccl, None) => Err(
            "parallel.exchange = \"nccl\" needs GPUs (CUDA); on the CPU the devices exchange through host memory: set parallel.exchange = \"auto\" or \"host\"".into(),
        ),
        (_, Some(Err(why))) => Err(format!(
            "parallel.exchange = \"{}\": NCCL cannot be used: {why}",
            match asked {
                ExchangeChoice::Nccl => "nccl",
                _ => "auto",
            }
        )),
    }
}

/// Every device's end of an exchange among threads of one process (device order), what
/// stops them all, and the host engine's board (to clear after a failed step).
#[allow(clippy::type_complexity)]
pub fn for_threads<B: CollectiveBackend>(
    engine: &Engine,
    devices: &[B::Device],
) -> Result<(Vec<Box<dyn Exchange<B>>>, Aborter, Option<Arc<HostBoard>>), String> {
    match engine {
        Engine::Device(name) => {
            let comms = B::communicators(devices)?;
            let all = comms.clone();
            let aborter = Aborter::new(move |_| all.iter().for_each(|c| c.abort()));
            let exchanges = comms
                .into_iter()
                .zip(devices)
                .map(|(c, d)| {
                    Box::new(DeviceExchange::<B>::new(c, d.clone(), name.clone()))
                        as Box<dyn Exchange<B>>
                })
                .collect();
            Ok((exchanges, aborter, None))
        }
        Engine::Host => {
            let board = HostBoard::new(devices.len());
            let exchanges = (0..devices.len())
                .map(|i| Box::new(board.exchange(i)) as Box<dyn Exchange<B>>)
                .collect();
            let b = board.clone();
            Ok((
                exchanges,
                Aborter::new(move |why| b.abort(why)),
                Some(board),
            ))
        }
    }
}

/// This process's end of an exchange among the processes of `group`, on `device`:
/// NCCL's group id goes from rank 0 to the others through `group`.
pub fn for_process<B: CollectiveBackend>(
    engine: &Engine,
    group: &Arc<std::sync::Mutex<Group>>,
    device: &B::Device,
) -> Result<Box<dyn Exchange<B>>, TrainError> {
    match engine {
        Engine::Device(name) => {
            let mut g = group.lock().unwrap_or_else(|e| e.into_inner());
            let (rank, size) = (g.rank(), g.size());
            let mut id = if rank == 0 {
                B::new_group_id().map_err(TrainError::ExchangeUnavailable)?
            } else {
                vec![0u8; 128]
            };
            g.broadcast_bytes(&mut id, "the start (NCCL's group id)")?;
            drop(g);
            let comm = B::join_group(device, &id, rank, size)
                .map_err(|e| TrainError::Exchange(ExchangeError::Failed(e)))?;
            Ok(Box::new(DeviceExchange::<B>::new(
                comm,
                device.clone(),
                name.clone(),
            )))
        }
        Engine::Host => Ok(Box::new(TcpExchange::new(group.clone()))),
    }
}
