//! The exchange of processes through host memory and TCP: each rank reads its buffers
//! back and the group (`collective::Group`, a star through rank 0) adds them in rank
//! order, the same order the threads of one process add theirs in, so both give the
//! same numbers. What the CPU backend uses across processes; on GPUs NCCL replaces it.

use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::host::{from_host, to_host};
use super::{Aborter, Exchange, ExchangeError};
use crate::collective::{CollectiveError, Group};

/// A process's end of the exchange: the group it shares with the strategy, which also
/// agrees on stopping and adds metric totals over it.
pub struct TcpExchange {
    group: Arc<Mutex<Group>>,
    rank: usize,
    size: usize,
}

impl TcpExchange {
    pub fn new(group: Arc<Mutex<Group>>) -> Self {
        let (rank, size) = {
            let g = group.lock().unwrap_or_else(|e| e.into_inner());
            (g.rank(), g.size())
        };
        TcpExchange { group, rank, size }
    }

    fn run<B: Backend>(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
        sum: bool,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        let Some(device) = buffers.first().map(|t| t.device()) else {
            return Ok(buffers);
        };
        let mut host = to_host(buffers);
        let mut slices: Vec<&mut [f32]> = host.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut group = self.group.lock().unwrap_or_else(|e| e.into_inner());
        let done = if sum {
            group.sum_f32(&mut slices, 0, during).map(|_| ())
        } else {
            group.broadcast_f32(&mut slices, during)
        };
        done.map_err(|e: CollectiveError| ExchangeError::Failed(e.to_string()))?;
        Ok(from_host::<B>(&host, &device))
    }
}

impl<B: Backend> Exchange<B> for TcpExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        self.run(buffers, during, true)
    }

    fn broadcast(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        self.run(buffers, during, false)
    }

    fn aborter(&self) -> Aborter {
        // A rank that fails closes its socket and the others hear of it at once; a
        // hung one is a read timeout.
        Aborter::none()
    }

    fn engine(&self) -> String {
        "TCP through rank 0".into()
    }
}
