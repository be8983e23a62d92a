//! One rank of a multi-process run (`kiln launch`, `srun`): this process trains its
//! shard of every global batch on its one device; the exchange (NCCL across the
//! processes' GPUs, or TCP through rank 0 on the CPU) sums the gradients, and the
//! group agrees every step on whether to stop, so every rank stops at the same step.
//! Rank 0 alone writes checkpoints and reports. A run of one process exchanges nothing,
//! unless `parallel.exchange = "nccl"` asks for its path anyway.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::single::read_totals;
use super::{
    ReplicaError, Replicable, StepInput, StepOutput, StepTimes, TIME_EVERY_STEPS, Totals,
    TrainingStrategy, fault_here, replica_grads,
};
use crate::collective::{Group, Member};
use crate::config::TrainConfig;
use crate::data::{Batch, Loader};
use crate::ops::TrainBackend;
use crate::train::error::TrainError;
use crate::train::exchange::{
    Aborter, BucketPlan, Exchange, mean_buffers, share_module, sum_grads,
};
use crate::train::optim::Optim;
use crate::train::step::{Sums, apply_clipped, micro_batches};
use crate::train::watchdog::{Pending, Watchdog};

/// Flag bit of a step's agreement: this rank was asked to stop (SIGINT/SIGTERM).
const STOP: u32 = 1;

/// How the ranks exchange gradients.
pub struct ProcessExchange<B: TrainBackend> {
    pub exchange: Box<dyn Exchange<B::InnerBackend>>,
    pub wire: Option<burn::tensor::FloatDType>,
    pub bucket_bytes: usize,
}

pub struct Processes<B: TrainBackend> {
    group: Arc<Mutex<Group>>,
    rank: usize,
    size: usize,
    members: Vec<Member>,
    device: B::Device,
    /// How failures name this process's device.
    name: String,
    train: TrainConfig,
    exchange: Option<ProcessExchange<B>>,
    plan: Option<BucketPlan>,
    sums: Option<Sums<B::InnerBackend>>,
    steps: u64,
    times: StepTimes,
    exchange_paused: bool,
}

impl<B: TrainBackend> Processes<B> {
    /// This process's place in `group`, training on `device` (named `device_name`):
    /// one device per process, and a global batch every rank gets a shard of.
    pub fn new(
        group: Arc<Mutex<Group>>,
        device: B::Device,
        device_name: &str,
        devices: usize,
        train: &TrainConfig,
        exchange: Option<ProcessExchange<B>>,
    ) -> Result<Self, TrainError> {
        let (rank, size, members) = {
            let g = group.lock().unwrap_or_else(|e| e.into_inner());
            (g.rank(), g.size(), g.members().to_vec())
        };
        check_world(size, devices, train)?;
        Ok(Processes {
            group,
            rank,
            size,
            members,
            device,
            name: format!("rank {rank} ({device_name})"),
            train: train.clone(),
            exchange,
            plan: None,
            sums: None,
            steps: 0,
            times: StepTimes::default(),
            exchange_paused: false,
        })
    }

    fn group(&self) -> std::sync::MutexGuard<'_, Group> {
        self.group.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B: TrainBackend, M: Replicable<B>> TrainingStrategy<B, M> for Processes<B> {
    fn devices(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("rank {}: {} on {}", m.rank, m.device, m.host))
            .collect()
    }

    fn lead(&self) -> bool {
        self.rank == 0
    }

    fn position(&self) -> usize {
        self.rank
    }

    fn shard(&self, train: Loader, test: Loader) -> (Loader, Loader) {
        (
            train.sharded(self.rank, self.size),
            test.sharded(self.rank, self.size),
        )
    }

    fn start(&mut self, model: M, _: &Optim<M, B>) -> Result<M, TrainError> {
        match self.exchange.as_mut() {
            Some(e) => Ok(share_module::<B, M>(
                e.exchange.as_mut(),
                model,
                "the start (rank 0's weights)",
            )?),
            None => Ok(model),
        }
    }

    fn step(
        &mut self,
        model: M,
        optim: &mut Optim<M, B>,
        batch: Batch,
        input: &StepInput,
        watchdog: &Watchdog,
    ) -> Result<StepOutput<M>, TrainError> {
        fault_here(input, self.rank).map_err(|message| ReplicaError::Failed {
            device: self.name.clone(),
            position: self.rank,
            step: input.step,
            message,
        })?;
        let global = self.train.batch_size;
        let during = format!("step {}", input.step);
        self.steps += 1;
        let timed = self.steps.is_multiple_of(TIME_EVERY_STEPS);
        let mut times = StepTimes::default();
        let micros = micro_batches(batch, &self.train);
        let (grads, sums) = replica_grads::<B, M>(
            &model,
            micros,
            global,
            self.train.label_smoothing,
            input.scale,
            &self.device,
            None,
            &during,
            timed.then_some(&mut times),
        )?;
        self.sums = Sums::accumulate(self.sums.take(), sums);
        let grads = match self.exchange.as_mut().filter(|_| !self.exchange_paused) {
            Some(e) => {
                // Waiting for the other ranks is not this device hanging: the group's
                // own timeout names the rank that went silent. NCCL's all-reduce is only
                // queued here; a peer that fails shows in the agreement below.
                let waits = e.exchange.waits_for_peers();
                if waits {
                    watchdog.step_finished();
                }
                let plan = self
                    .plan
                    .get_or_insert_with(|| BucketPlan::new(&model, e.bucket_bytes, e.wire));
                let before = std::time::Instant::now();
                let summed =
                    sum_grads::<B>(e.exchange.as_mut(), grads, plan, &self.device, &during)?;
                if timed {
                    let _ = B::sync(&self.device);
                    times.exchange_s += before.elapsed().as_secs_f64();
                }
                if waits {
                    watchdog.step_started(input.step);
                }
                summed
            }
            None => grads,
        };
        watchdog.step_finished();
        let flags = if self.size > 1 {
            // Everything this rank queued goes to the device first: a collective held
            // in a queue while this rank waits on the others would wait forever.
            <B::InnerBackend as crate::ops::CollectiveBackend>::flush(&self.device);
            self.group()
                .sum_f32(&mut [], if input.stop_asked { STOP } else { 0 }, &during)?
        } else if input.stop_asked {
            STOP
        } else {
            0
        };
        watchdog.step_started(input.step);
        if timed {
            self.times.steps += times.steps;
            self.times.compute_s += times.compute_s;
            self.times.exchange_s += times.exchange_s;
        }
        let (model, stepped) = apply_clipped(
            model,
            optim,
            grads,
            input.lr,
            self.train.grad_clip_norm,
            input.scale,
        );
        Ok(StepOutput {
            model,
            stepped,
            images: global,
            stop: Some(flags & STOP != 0),
        })
    }

    fn sync_buffers(&mut self, model: M, step: u64) -> Result<M, TrainError> {
        match self.exchange.as_mut() {
            Some(e) => Ok(mean_buffers::<B, M>(
                e.exchange.as_mut(),
                model,
                &format!("the BatchNorm statistics at step {step}"),
            )?),
            None => Ok(model),
        }
    }

    fn totals(&mut self, reset: bool) -> Result<Totals, TrainError> {
        Ok(read_totals(&mut self.sums, reset))
    }

    fn sum_over_processes(&mut self, totals: Totals, during: &str) -> Result<Totals, TrainError> {
        let mut v = [totals.0, totals.1, totals.2 as f64];
        self.group().sum_f64(&mut v, during)?;
        Ok((v[0], v[1], v[2].round() as usize))
    }

    fn first_step_done(&mut self, hang_timeout_s: f64) {
        self.group().set_timeout(collective_timeout(hang_timeout_s));
    }

    fn pending(&self) -> Pending {
        let (rank, name) = (self.rank, self.name.clone());
        Box::new(move || Some((rank, name.clone())))
    }

    fn aborter(&self) -> Aborter {
        self.exchange
            .as_ref()
            .map_or_else(Aborter::none, |e| e.exchange.aborter())
    }

    fn exchange_engine(&self) -> Option<String> {
        self.exchange.as_ref().map(|e| e.exchange.engine())
    }

    fn exchange_gradients(&mut self, on: bool) {
        self.exchange_paused = !on;
    }

    fn take_times(&mut self) -> StepTimes {
        std::mem::take(&mut self.times)
    }
}

/// How long a rank waits for the others in a collective once the first step (kernel
/// compilation, minutes on a cold cache) is behind them: `watchdog.hang_timeout_s`,
/// or 10 minutes, which covers an evaluation pass or a slow checkpoint on rank 0.
fn collective_timeout(hang_timeout_s: f64) -> Duration {
    Duration::from_secs_f64(if hang_timeout_s > 0.0 {
        hang_timeout_s
    } else {
        600.0
    })
}

/// A multi-process run's rules: one device per process, a shard for every rank (and
/// equal micro-batches in every shard).
fn check_world(ranks: usize, devices: usize, cfg: &TrainConfig) -> Result<(), TrainError> {
    if devices != 1 {
        return Err(TrainError::DevicesPerRank { devices });
    }
    let (batch, k) = (cfg.batch_size, cfg.grad_accum_steps.max(1));
    if batch < ranks {
        return Err(TrainError::BatchPerRank {
            batch,
            ranks,
            why: " (a shard for each)",
            multiple: ranks,
        });
    }
    if k > 1 && !batch.is_multiple_of(ranks * k) {
        return Err(TrainError::BatchPerRank {
            batch,
            ranks,
            why: " in equal micro-batches of train.grad_accum_steps",
            multiple: ranks * k,
        });
    }
    Ok(())
}
