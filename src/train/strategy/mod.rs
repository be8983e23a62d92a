//! Ways of training one model: on one device ([`Single`]), on several devices driven by
//! threads of one process ([`Replicas`]), or as one rank of several processes
//! ([`Processes`]). The loop (`fit`) calls the same [`TrainingStrategy`] whatever the
//! way; each way holds its gradient exchange (`exchange`), the one object that differs
//! between the CPU (host memory, TCP) and CUDA (NCCL).

mod processes;
mod replicas;
mod shards;
mod single;

pub use processes::{ProcessExchange, Processes};
pub use replicas::{Replicas, ThreadExchanges};
pub use shards::shard_sizes;
pub use single::Single;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use super::error::TrainError;
use super::exchange::{Aborter, BucketPlan, Exchange, ExchangeError, sum_grads};
use super::faults::act_out;
use super::optim::Optim;
use super::step::{Sums, forward_backward};
use super::watchdog::{Pending, Watchdog};
use crate::config::FaultKind;
use crate::data::{Batch, Loader};
use crate::model::Classifier;
use crate::ops::TrainBackend;
use crate::report::DeviceLoad;

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica on {device} failed at step {step}: {message}")]
    Failed {
        device: String,
        /// Position of the device among those the run uses (its rank across processes).
        position: usize,
        step: u64,
        message: String,
    },
    #[error(
        "train.batch_size / train.grad_accum_steps = {micro} images cannot be split over {devices} devices"
    )]
    TooSmall { micro: usize, devices: usize },
}

/// What one optimizer step is given besides the batch.
#[derive(Debug, Clone, Copy)]
pub struct StepInput {
    /// The step's number, 1-based.
    pub step: u64,
    pub lr: f64,
    /// fp16's loss scale.
    pub scale: Option<f64>,
    /// The device (position among the run's) that acts out an injected fault.
    pub fault: Option<(usize, FaultKind)>,
    /// This process was asked to stop (SIGINT/SIGTERM) before the step: what it tells
    /// the other processes.
    pub stop_asked: bool,
}

/// What one optimizer step gives back.
pub struct StepOutput<M> {
    pub model: M,
    /// `false`: fp16 gradients overflowed and the step was skipped.
    pub stepped: bool,
    /// Images of the global batch (every device's, every process's).
    pub images: usize,
    /// Across processes: whether some process was asked to stop (every process stops
    /// after this step). `None`: this process's own interrupt decides.
    pub stop: Option<bool>,
}

/// Running totals of the training loss and accuracy: loss × images, correct, images.
pub type Totals = (f64, f64, usize);

/// The time a step's parts took on the devices, from steps synchronised for it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Steps measured.
    pub steps: usize,
    /// Forward and backward, summed over the measured steps and the devices.
    pub compute_s: f64,
    /// The gradient exchange, likewise.
    pub exchange_s: f64,
}

/// One way of training: what `fit` calls, whatever the number of devices and processes.
pub trait TrainingStrategy<B: TrainBackend, M: AutodiffModule<B>> {
    /// The devices used, as reports name them.
    fn devices(&self) -> Vec<String>;
    /// Whether this process writes checkpoints and reports (rank 0, or the only one).
    fn lead(&self) -> bool;
    /// Where this process's first device stands among the run's devices (its rank in a
    /// multi-process run): faults and failure records count in these positions.
    fn position(&self) -> usize;
    /// The loaders this process reads: the whole batches, or its shard of each.
    fn shard(&self, train: Loader, test: Loader) -> (Loader, Loader);
    /// Makes every replica start from the same weights and optimizer state.
    fn start(&mut self, model: M, optim: &Optim<M, B>) -> Result<M, TrainError>;
    /// One optimizer step on `batch` (this process's share of the global batch).
    /// `watchdog` is paused while this process waits for other processes, whose own
    /// timeouts name the one that went silent.
    fn step(
        &mut self,
        model: M,
        optim: &mut Optim<M, B>,
        batch: Batch,
        input: &StepInput,
        watchdog: &Watchdog,
    ) -> Result<StepOutput<M>, TrainError>;
    /// `model` with BatchNorm's running statistics the same on every replica: before
    /// evaluating or saving it.
    fn sync_buffers(&mut self, model: M, step: u64) -> Result<M, TrainError>;
    /// This process's training totals since the last reset (one read of the devices).
    fn totals(&mut self, reset: bool) -> Result<Totals, TrainError>;
    /// `totals` summed over every process of the run (a collective: every process
    /// calls it at the same point).
    fn sum_over_processes(&mut self, totals: Totals, during: &str) -> Result<Totals, TrainError>;
    /// After the first step (kernel compilation) of this process.
    fn first_step_done(&mut self, hang_timeout_s: f64);
    /// Which device the current step still waits for (for the watchdog).
    fn pending(&self) -> Pending;
    /// What stops every exchange in flight (for the watchdog).
    fn aborter(&self) -> Aborter;
    /// Each device's timed work since the last call (several devices of one process;
    /// empty otherwise), and resets it.
    fn take_load(&mut self) -> Vec<DeviceLoad> {
        Vec::new()
    }
    /// How the gradients are exchanged, as reports name it; `None` alone.
    fn exchange_engine(&self) -> Option<String>;
    /// Whether the steps that follow exchange gradients (on from the start). Only
    /// `kiln bench` turns it off, to time the same steps without the exchange: the
    /// replicas then train apart. Nothing to turn off without an exchange.
    fn exchange_gradients(&mut self, on: bool) {
        let _ = on;
    }
    /// The synchronised timings since the last call (the bench).
    fn take_times(&mut self) -> StepTimes;
}

/// One replica's part of a step: its micro-batches' gradients (each loss weighted by
/// its images' share of the `global` batch, and by fp16's `scale`), then summed over
/// every replica when there is an exchange. `timed` synchronises the device after the
/// backward pass and after the exchange, to time each.
#[allow(clippy::too_many_arguments)]
pub fn replica_grads<B: TrainBackend, M: Classifier<B> + AutodiffModule<B>>(
    model: &M,
    micros: Vec<Batch>,
    global: usize,
    label_smoothing: f64,
    scale: Option<f64>,
    device: &B::Device,
    exchange: Option<(&mut dyn Exchange<B::InnerBackend>, &BucketPlan)>,
    during: &str,
    timed: Option<&mut StepTimes>,
) -> Result<(GradientsParams, Sums<B::InnerBackend>), ExchangeError> {
    let start = std::time::Instant::now();
    let mut acc = burn::optim::GradientsAccumulator::<M>::new();
    let mut sums = None;
    for micro in micros {
        if micro.labels.is_empty() {
            continue;
        }
        let weight = micro.labels.len() as f64 / global as f64 * scale.unwrap_or(1.0);
        let (g, s) = forward_backward(model, micro, device, weight, label_smoothing);
        acc.accumulate(model, g);
        sums = Sums::accumulate(sums, s);
    }
    let sums = sums.unwrap_or_else(|| Sums::zeros(device));
    let mut grads = acc.grads();
    let mut timed = timed;
    if let Some(t) = timed.as_deref_mut() {
        let _ = B::sync(device);
        t.compute_s += start.elapsed().as_secs_f64();
    }
    if let Some((exchange, plan)) = exchange {
        let before = std::time::Instant::now();
        grads = sum_grads::<B>(exchange, grads, plan, device, during)?;
        if let Some(t) = timed.as_deref_mut() {
            let _ = B::sync(device);
            t.exchange_s += before.elapsed().as_secs_f64();
        }
    }
    if let Some(t) = timed {
        t.steps += 1;
    }
    Ok((grads, sums))
}

/// Acts out an injected fault meant for position `position`, if any.
fn fault_here(input: &StepInput, position: usize) -> Result<(), String> {
    match input.fault {
        Some((p, kind)) if p == position => act_out(kind),
        _ => Ok(()),
    }
}

/// How often a device's step is synchronised to time its parts when nothing else
/// synchronises it: each costs one bubble in the device's queue.
const TIME_EVERY_STEPS: u64 = 25;

/// Short for what replica strategies need of a model.
pub trait Replicable<B: AutodiffBackend>: Classifier<B> + AutodiffModule<B> + 'static {}
impl<B: AutodiffBackend, M: Classifier<B> + AutodiffModule<B> + 'static> Replicable<B> for M {}

/// The way of training a run takes: as one rank of `group` when the process is part of
/// a multi-process run; on several `devices` with threads; on one device alone (unless
/// `parallel.exchange = "nccl"` asks for the exchange's path even there).
pub fn choose<B: TrainBackend, M: Replicable<B>>(
    devices: Vec<B::Device>,
    names: Vec<String>,
    group: Option<crate::collective::Group>,
    train: &crate::config::TrainConfig,
    parallel: &crate::config::ParallelConfig,
) -> Result<Box<dyn TrainingStrategy<B, M>>, TrainError> {
    use super::exchange::{Engine, engine, for_process, for_threads};
    use crate::config::{Exchange as Choice, ExchangeDtype};
    let wire =
        (parallel.exchange_dtype == ExchangeDtype::Bf16).then_some(burn::tensor::FloatDType::BF16);
    let bucket_bytes = (parallel.bucket_mib as usize) << 20;
    let alone = devices.len() == 1 && parallel.exchange != Choice::Nccl;
    let chosen =
        || engine::<B::InnerBackend>(parallel.exchange).map_err(TrainError::ExchangeUnavailable);
    if let Some(group) = group {
        let group = std::sync::Arc::new(std::sync::Mutex::new(group));
        let size = group.lock().unwrap_or_else(|e| e.into_inner()).size();
        let exchange = if size == 1 && parallel.exchange != Choice::Nccl {
            None
        } else {
            let e = chosen()?;
            Some(ProcessExchange {
                exchange: for_process::<B::InnerBackend>(&e, &group, &devices[0])?,
                wire,
                bucket_bytes,
            })
        };
        return Ok(Box::new(Processes::<B>::new(
            group,
            devices[0].clone(),
            &names[0],
            devices.len(),
            train,
            exchange,
        )?));
    }
    if alone {
        return Ok(Box::new(Single::<B>::new(
            devices[0].clone(),
            names[0].clone(),
            train,
        )));
    }
    let weights = &parallel.device_weights;
    if !weights.is_empty() && weights.len() != devices.len() {
        return Err(TrainError::DeviceWeights {
            weights: weights.len(),
            devices: devices.len(),
        });
    }
    let e = chosen()?;
    let (exchanges, aborter, board) =
        for_threads::<B::InnerBackend>(&e, &devices).map_err(TrainError::ExchangeUnavailable)?;
    let engine_name = match &e {
        Engine::Device(v) => v.clone(),
        Engine::Host => "host memory".into(),
    };
    Ok(Box::new(Replicas::<B, M>::new(
        &devices,
        &names,
        weights,
        parallel.strategy,
        train,
        ThreadExchanges {
            exchanges,
            aborter,
            board,
            engine: engine_name,
            wire,
            bucket_bytes,
        },
    )))
}
