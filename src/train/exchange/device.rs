//! The exchange on the devices themselves ([`CollectiveBackend`]: NCCL on CUDA): each
//! buffer is summed where it lies, queued on the device's stream after the backward
//! pass that made it, and nothing crosses host memory. The collectives of a step are
//! handed to the device together ([`CollectiveBackend::flush`]), so that no device
//! waits in a collective whose peer still holds its half in a queue.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::{Aborter, Exchange, ExchangeError};
use crate::ops::{CollectiveBackend, Comm};

pub struct DeviceExchange<B: Backend> {
    comm: Comm,
    device: B::Device,
    engine: String,
}

impl<B: CollectiveBackend> DeviceExchange<B> {
    /// `engine`: how reports name it ("NCCL 2.27.3").
    pub fn new(comm: Comm, device: B::Device, engine: String) -> Self {
        DeviceExchange {
            comm,
            device,
            engine,
        }
    }

    fn run(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
        root: Option<usize>,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        if let Some(e) = self.comm.error() {
            return Err(ExchangeError::Failed(format!("{e} (before {during})")));
        }
        let out: Vec<Tensor<B, 1>> = buffers
            .into_iter()
            .map(|t| {
                let x = t.into_primitive().tensor();
                let y = match root {
                    None => B::all_reduce_sum(x, &self.comm),
                    Some(r) => B::broadcast(x, &self.comm, r),
                };
                Tensor::from_primitive(TensorPrimitive::Float(y))
            })
            .collect();
        B::flush(&self.device);
        match self.comm.error() {
            Some(e) => Err(ExchangeError::Failed(format!("{e} (during {during})"))),
            None => Ok(out),
        }
    }
}

impl<B: CollectiveBackend> Exchange<B> for DeviceExchange<B> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn all_reduce(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        self.run(buffers, during, None)
    }

    fn all_reduce_buckets(
        &mut self,
        buckets: Vec<Vec<FloatTensor<B>>>,
        during: &str,
    ) -> Result<Vec<Vec<FloatTensor<B>>>, ExchangeError> {
        if let Some(e) = self.comm.error() {
            return Err(ExchangeError::Failed(format!("{e} (before {during})")));
        }
        let out = buckets
            .into_iter()
            .map(|b| B::all_reduce_many(b, &self.comm))
            .collect();
        B::flush(&self.device);
        match self.comm.error() {
            Some(e) => Err(ExchangeError::Failed(format!("{e} (during {during})"))),
            None => Ok(out),
        }
    }

    fn broadcast(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        self.run(buffers, during, Some(0))
    }

    fn aborter(&self) -> Aborter {
        let comm = self.comm.clone();
        Aborter::new(move |_| comm.abort())
    }

    fn engine(&self) -> String {
        self.engine.clone()
    }

    fn waits_for_peers(&self) -> bool {
        false
    }
}
