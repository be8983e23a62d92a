//! Training on one device: the whole global batch, no exchange.

use super::{
    ReplicaError, Replicable, StepInput, StepOutput, StepTimes, Totals, TrainingStrategy,
    fault_here,
};
use crate::config::TrainConfig;
use crate::data::{Batch, Loader};
use crate::ops::TrainBackend;
use crate::train::error::TrainError;
use crate::train::exchange::Aborter;
use crate::train::optim::Optim;
use crate::train::step::{Sums, train_step};
use crate::train::watchdog::{Pending, Watchdog};

pub struct Single<B: TrainBackend> {
    device: B::Device,
    name: String,
    train: TrainConfig,
    sums: Option<Sums<B::InnerBackend>>,
}

impl<B: TrainBackend> Single<B> {
    pub fn new(device: B::Device, name: String, train: &TrainConfig) -> Self {
        Single {
            device,
            name,
            train: train.clone(),
            sums: None,
        }
    }
}

impl<B: TrainBackend, M: Replicable<B>> TrainingStrategy<B, M> for Single<B> {
    fn devices(&self) -> Vec<String> {
        vec![self.name.clone()]
    }

    fn lead(&self) -> bool {
        true
    }

    fn position(&self) -> usize {
        0
    }

    fn shard(&self, train: Loader, test: Loader) -> (Loader, Loader) {
        (train, test)
    }

    fn start(&mut self, model: M, _: &Optim<M, B>) -> Result<M, TrainError> {
        Ok(model)
    }

    fn step(
        &mut self,
        model: M,
        optim: &mut Optim<M, B>,
        batch: Batch,
        input: &StepInput,
        _: &Watchdog,
    ) -> Result<StepOutput<M>, TrainError> {
        fault_here(input, 0).map_err(|message| ReplicaError::Failed {
            device: self.name.clone(),
            position: 0,
            step: input.step,
            message,
        })?;
        let images = batch.labels.len();
        let (model, sums, stepped) = train_step(
            model,
            optim,
            batch,
            input.lr,
            &self.train,
            &self.device,
            input.scale,
        );
        self.sums = Sums::accumulate(self.sums.take(), sums);
        Ok(StepOutput {
            model,
            stepped,
            images,
            stop: None,
        })
    }

    fn sync_buffers(&mut self, model: M, _: u64) -> Result<M, TrainError> {
        Ok(model)
    }

    fn totals(&mut self, reset: bool) -> Result<Totals, TrainError> {
        Ok(read_totals(&mut self.sums, reset))
    }

    fn sum_over_processes(&mut self, totals: Totals, _: &str) -> Result<Totals, TrainError> {
        Ok(totals)
    }

    fn first_step_done(&mut self, _: f64) {}

    fn pending(&self) -> Pending {
        let name = self.name.clone();
        Box::new(move || Some((0, name.clone())))
    }

    fn aborter(&self) -> Aborter {
        Aborter::none()
    }

    fn exchange_engine(&self) -> Option<String> {
        None
    }

    fn take_times(&mut self) -> StepTimes {
        StepTimes::default()
    }
}

/// The totals of `sums` (one read of the device), emptied when `reset`.
pub fn read_totals<B: burn::tensor::backend::Backend>(
    sums: &mut Option<Sums<B>>,
    reset: bool,
) -> Totals {
    let totals = match sums {
        Some(s) => s.clone().totals(),
        None => (0.0, 0.0, 0),
    };
    if reset {
        *sums = None;
    }
    totals
}
