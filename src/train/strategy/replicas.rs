//! Several devices driven by threads of one process. Every global batch is split into
//! one shard per device (sizes follow `parallel.device_weights`, never empty); one
//! long-lived worker thread per device runs forward and backward on its shard and sums
//! its gradients with the other workers' through its end of the exchange (NCCL on the
//! GPUs, host memory on the CPU), so the update equals single-device training on the
//! whole batch.
//!
//! The main device's worker trains the main model itself and hands the summed
//! gradients to the main thread, which takes the optimizer step. That worker queues
//! its work under the main thread's `StreamId`: Burn's fusion and cubecl keep one
//! stream per `StreamId`, and a buffer used on another stream than the one that wrote
//! it costs an event wait and a slot in a garbage-collection queue of 8 that makes the
//! host wait for the GPU when full; with two streams, every optimizer step paid that
//! for every parameter and gradient. `ddp`: every other
//! worker keeps a replica and an optimizer and takes the same step on the same sum.
//! `dp`: only the main model steps; the other replicas take its weights from the
//! exchange at the start of the next step. Replicas start from one broadcast of the
//! main model's weights and statistics.
//!
//! BatchNorm normalises each shard with its own batch statistics; each replica keeps
//! its own running statistics, averaged over the replicas before every evaluation and
//! checkpoint (`exchange::mean_buffers`). Metric sums stay on each device until a
//! report asks for them.
//!
//! A replica that fails (an error or a panic on its thread) makes the step fail with an
//! error naming the device; the other replicas' exchanges are aborted, so nothing waits
//! for it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::module::{ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, StreamId, Tensor};

use super::single::read_totals;
use super::{
    ReplicaError, Replicable, StepInput, StepOutput, StepTimes, TIME_EVERY_STEPS, Totals,
    TrainingStrategy, fault_here, replica_grads, shard_sizes,
};
use crate::config::{DataParallel, TrainConfig};
use crate::data::{Batch, Loader};
use crate::ops::TrainBackend;
use crate::report::DeviceLoad;
use crate::train::error::TrainError;
use crate::train::exchange::{
    Aborter, BucketPlan, Exchange, ExchangeError, HostBoard, mean_buffers, share_module,
    share_trainable,
};
use crate::train::optim::Optim;
use crate::train::step::{Sums, apply_clipped, micro_batches};
use crate::train::watchdog::{Pending, Watchdog};

/// The exchange of every worker of one process, and what stops them all.
pub struct ThreadExchanges<B: TrainBackend> {
    /// One per device, in device order.
    pub exchanges: Vec<Box<dyn Exchange<B::InnerBackend>>>,
    pub aborter: Aborter,
    /// The host engine's board, to clear after a failed step.
    pub board: Option<Arc<HostBoard>>,
    pub engine: String,
    /// Gradients travel as this (bf16 rounding) and come back as f32.
    pub wire: Option<FloatDType>,
    /// Bytes per gradient bucket.
    pub bucket_bytes: usize,
}

struct Job<M> {
    /// The main model, for the main device's worker; `None`: the worker's own replica.
    model: Option<M>,
    micros: Vec<Batch>,
    global: usize,
    input: StepInput,
    clip: f64,
    label_smoothing: f64,
    timed: bool,
    /// Whether the gradients are summed over the replicas ([`TrainingStrategy::exchange_gradients`]).
    exchange: bool,
}

/// The main model and, `ddp`, the main optimizer with its state serialised.
type Start<B, M> = Box<(M, Option<(Optim<M, B>, Vec<u8>)>)>;

enum Msg<B: TrainBackend, M: Replicable<B>> {
    Start(Start<B, M>),
    Work(Box<Job<M>>),
    /// Average BatchNorm's statistics; the main device's worker gets the main model.
    SyncBuffers(Option<M>, u64),
    Totals(bool),
}

/// What a worker's step gives back: the summed gradients (the main device's worker)
/// and, on a timed step, its times.
struct Worked {
    grads: Option<GradientsParams>,
    times: StepTimes,
}

enum Reply<M> {
    Started(Result<(), String>),
    Worked(Result<Worked, String>),
    Synced(Result<Option<M>, String>),
    Totals(Result<Totals, String>),
}

struct Worker<B: TrainBackend, M: Replicable<B>> {
    jobs: Sender<Msg<B, M>>,
    handle: JoinHandle<()>,
}

/// The worker threads of a data-parallel run; one per device, `devices[0]` the main one.
pub struct Replicas<B: TrainBackend, M: Replicable<B>> {
    style: DataParallel,
    train: TrainConfig,
    names: Vec<String>,
    workers: Vec<Worker<B, M>>,
    replies: Receiver<(usize, Reply<M>)>,
    weights: Vec<f64>,
    load: Vec<DeviceLoad>,
    /// Which devices the current step still waits for.
    pending: Arc<Mutex<Vec<bool>>>,
    aborter: Aborter,
    board: Option<Arc<HostBoard>>,
    engine: String,
    started: bool,
    steps: u64,
    /// Every step is synchronised anyway (the host engine reads every buffer back).
    always_timed: bool,
    times: StepTimes,
    exchange_paused: bool,
}

impl<B: TrainBackend, M: Replicable<B>> Replicas<B, M> {
    /// Workers on `devices` (named `names` in reports), sharing batches by `weights`
    /// (empty: equally).
    pub fn new(
        devices: &[B::Device],
        names: &[String],
        weights: &[f64],
        style: DataParallel,
        train: &TrainConfig,
        exchanges: ThreadExchanges<B>,
    ) -> Self {
        let (reply_tx, replies) = channel();
        let ThreadExchanges {
            exchanges,
            aborter,
            board,
            engine,
            wire,
            bucket_bytes,
        } = exchanges;
        let main_stream = StreamId::current();
        let workers = devices
            .iter()
            .zip(exchanges)
            .enumerate()
            .map(|(i, (device, exchange))| {
                let (jobs, rx) = channel::<Msg<B, M>>();
                let ends = WorkerEnds {
                    i,
                    rx,
                    reply: reply_tx.clone(),
                    device: device.clone(),
                    exchange,
                    style,
                    wire,
                    bucket_bytes,
                };
                let stream = (i == 0).then_some(main_stream);
                let handle = std::thread::Builder::new()
                    .name(format!("kiln-replica-{i}"))
                    .spawn(move || match stream {
                        Some(s) => s.executes(|| worker_loop::<B, M>(ends)),
                        None => worker_loop::<B, M>(ends),
                    })
                    .expect("spawning a replica thread should succeed");
                Worker { jobs, handle }
            })
            .collect();
        let weights = if weights.len() == devices.len() {
            weights.to_vec()
        } else {
            vec![1.0; devices.len()]
        };
        let names: Vec<String> = (0..devices.len())
            .map(|i| {
                names
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| format!("device {i}"))
            })
            .collect();
        let load = names
            .iter()
            .map(|n| DeviceLoad {
                name: n.clone(),
                ..DeviceLoad::default()
            })
            .collect();
        Replicas {
            style,
            train: train.clone(),
            always_timed: board.is_some(),
            exchange_paused: false,
            names,
            workers,
            replies,
            weights,
            load,
            pending: Arc::new(Mutex::new(vec![false; devices.len()])),
            aborter,
            board,
            engine,
            started: false,
            steps: 0,
            times: StepTimes::default(),
        }
    }

    fn failed(&self, i: usize, step: u64, message: String) -> ReplicaError {
        ReplicaError::Failed {
            device: self.names[i].clone(),
            position: i,
            step,
            message,
        }
    }

    fn send(&self, i: usize, msg: Msg<B, M>, step: u64) -> Result<(), ReplicaError> {
        self.workers[i]
            .jobs
            .send(msg)
            .map_err(|_| self.failed(i, step, "its thread has exited".into()))
    }

    /// One message to every worker (`msg(i)`), then every worker's answer, in device
    /// order. The first failure aborts the others' exchanges so that none waits for
    /// the failed one, and is the error reported.
    fn round<T>(
        &mut self,
        step: u64,
        msg: impl Fn(usize) -> Msg<B, M>,
        mut take: impl FnMut(Reply<M>) -> Option<Result<T, String>>,
    ) -> Result<Vec<T>, ReplicaError> {
        let n = self.workers.len();
        for i in 0..n {
            self.send(i, msg(i), step)?;
        }
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fill(true);
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        let mut waiting = vec![true; n];
        // (device, message, whether it is an abort caused by another's failure)
        let mut errors: Vec<(usize, String, bool)> = Vec::new();
        while waiting.iter().any(|w| *w) {
            match self.replies.recv_timeout(Duration::from_millis(500)) {
                Ok((i, reply)) => {
                    let Some(result) = take(reply) else { continue };
                    waiting[i] = false;
                    self.pending.lock().unwrap_or_else(|e| e.into_inner())[i] = false;
                    match result {
                        Ok(v) => out[i] = Some(v),
                        Err(msg) => {
                            if errors.is_empty() {
                                self.aborter.abort(&format!("{} failed", self.names[i]));
                            }
                            let aborted = msg.starts_with(ABORTED);
                            errors.push((i, msg, aborted));
                        }
                    }
                }
                Err(_) => {
                    // A worker that died without replying would otherwise be waited for
                    // forever.
                    if let Some(i) =
                        (0..n).find(|&i| waiting[i] && self.workers[i].handle.is_finished())
                    {
                        self.aborter.abort(&format!("{} failed", self.names[i]));
                        return Err(self.failed(
                            i,
                            step,
                            "its thread stopped without a reply".into(),
                        ));
                    }
                }
            }
        }
        if !errors.is_empty() {
            if let Some(b) = &self.board {
                b.reset();
            }
            let (i, msg, _) = errors
                .iter()
                .find(|(_, _, aborted)| !aborted)
                .unwrap_or(&errors[0])
                .clone();
            return Err(self.failed(i, step, msg));
        }
        Ok(out
            .into_iter()
            .map(|v| v.expect("every worker answered"))
            .collect())
    }
}

/// How a worker's error says it was stopped because another replica failed.
const ABORTED: &str = "stopped: ";

impl<B: TrainBackend, M: Replicable<B>> TrainingStrategy<B, M> for Replicas<B, M> {
    fn devices(&self) -> Vec<String> {
        self.names.clone()
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

    fn start(&mut self, model: M, optim: &Optim<M, B>) -> Result<M, TrainError> {
        // Serialised once, however many replicas take it.
        let state = match self.style {
            DataParallel::Ddp if self.workers.len() > 1 => Some(
                optim
                    .to_bytes()
                    .map_err(|e| self.failed(1, 0, format!("copying the optimizer state: {e}")))?,
            ),
            _ => None,
        };
        let msg = |i: usize| {
            let optim = (i > 0)
                .then(|| state.clone().map(|b| (optim.clone(), b)))
                .flatten();
            Msg::Start(Box::new((model.clone(), optim)))
        };
        self.round(0, msg, |r| match r {
            Reply::Started(r) => Some(r),
            _ => None,
        })?;
        self.started = true;
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
        assert!(self.started, "Replicas::start comes before the first step");
        let n = self.workers.len();
        let global = batch.labels.len();
        let mut shards: Vec<Vec<Batch>> = (0..n).map(|_| Vec::new()).collect();
        for micro in micro_batches(batch, &self.train) {
            let k = micro.labels.len();
            let sizes = shard_sizes(k, &self.weights).ok_or(ReplicaError::TooSmall {
                micro: k,
                devices: n,
            })?;
            for (i, (shard, size)) in micro.split(&sizes).into_iter().zip(&sizes).enumerate() {
                self.load[i].images += size;
                shards[i].push(shard);
            }
        }
        self.steps += 1;
        let timed = self.always_timed || self.steps.is_multiple_of(TIME_EVERY_STEPS);
        let shards = Mutex::new(shards.into_iter().map(Some).collect::<Vec<_>>());
        let (train, input_copy, exchange) = (self.train.clone(), *input, !self.exchange_paused);
        let msg = |i: usize| {
            let micros = shards.lock().unwrap_or_else(|e| e.into_inner())[i]
                .take()
                .expect("one shard per worker");
            Msg::Work(Box::new(Job {
                model: (i == 0).then(|| model.clone()),
                micros,
                global,
                input: input_copy,
                clip: train.grad_clip_norm,
                label_smoothing: train.label_smoothing,
                timed,
                exchange,
            }))
        };
        let worked = self.round(input.step, msg, |r| match r {
            Reply::Worked(r) => Some(r),
            _ => None,
        })?;
        let mut main = None;
        if timed {
            self.times.steps += 1;
        }
        for (i, w) in worked.into_iter().enumerate() {
            if w.times.steps > 0 {
                self.load[i].steps += w.times.steps;
                self.load[i].busy_s += w.times.compute_s;
                self.times.compute_s += w.times.compute_s;
                self.times.exchange_s += w.times.exchange_s;
            }
            if i == 0 {
                main = w.grads;
            }
        }
        let grads = main.expect("the main device's worker hands over the summed gradients");
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
            stop: None,
        })
    }

    fn sync_buffers(&mut self, model: M, step: u64) -> Result<M, TrainError> {
        if !self.started {
            return Ok(model);
        }
        let main = Mutex::new(Some(model));
        let synced = self.round(
            step,
            |i| {
                let m = (i == 0)
                    .then(|| main.lock().unwrap_or_else(|e| e.into_inner()).take())
                    .flatten();
                Msg::SyncBuffers(m, step)
            },
            |r| match r {
                Reply::Synced(r) => Some(r),
                _ => None,
            },
        )?;
        Ok(synced
            .into_iter()
            .next()
            .flatten()
            .expect("the main device's worker hands back the main model"))
    }

    fn totals(&mut self, reset: bool) -> Result<Totals, TrainError> {
        if !self.started {
            return Ok((0.0, 0.0, 0));
        }
        let all = self.round(
            0,
            |_| Msg::Totals(reset),
            |r| match r {
                Reply::Totals(r) => Some(r),
                _ => None,
            },
        )?;
        Ok(all
            .into_iter()
            .fold((0.0, 0.0, 0), |a, t| (a.0 + t.0, a.1 + t.1, a.2 + t.2)))
    }

    fn sum_over_processes(&mut self, totals: Totals, _: &str) -> Result<Totals, TrainError> {
        Ok(totals)
    }

    fn first_step_done(&mut self, _: f64) {}

    fn pending(&self) -> Pending {
        let pending = self.pending.clone();
        let names = self.names.clone();
        Box::new(move || {
            let p = pending.lock().unwrap_or_else(|e| e.into_inner());
            p.iter().position(|w| *w).map(|i| (i, names[i].clone()))
        })
    }

    fn aborter(&self) -> Aborter {
        self.aborter.clone()
    }

    fn take_load(&mut self) -> Vec<DeviceLoad> {
        self.load
            .iter_mut()
            .map(|l| {
                std::mem::replace(
                    l,
                    DeviceLoad {
                        name: l.name.clone(),
                        ..DeviceLoad::default()
                    },
                )
            })
            .collect()
    }

    fn exchange_engine(&self) -> Option<String> {
        Some(self.engine.clone())
    }

    fn exchange_gradients(&mut self, on: bool) {
        self.exchange_paused = !on;
    }

    fn take_times(&mut self) -> StepTimes {
        std::mem::take(&mut self.times)
    }
}

impl<B: TrainBackend, M: Replicable<B>> Drop for Replicas<B, M> {
    fn drop(&mut self) {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Closing the job channels ends the worker loops. A worker still inside a step
        // (hung: the process is about to end) is left alone rather than waited for.
        for (w, busy) in self.workers.drain(..).zip(pending) {
            drop(w.jobs);
            if !busy {
                let _ = w.handle.join();
            }
        }
    }
}

/// What a worker thread holds of the learner.
struct WorkerEnds<B: TrainBackend, M: Replicable<B>> {
    i: usize,
    rx: Receiver<Msg<B, M>>,
    reply: Sender<(usize, Reply<M>)>,
    device: B::Device,
    exchange: Box<dyn Exchange<B::InnerBackend>>,
    style: DataParallel,
    wire: Option<FloatDType>,
    bucket_bytes: usize,
}

/// A worker's state between messages.
struct Replica<B: TrainBackend, M: Replicable<B>> {
    /// Its own model (every worker but the main device's).
    own: Option<M>,
    /// `ddp`: its own optimizer (every worker but the main device's).
    optim: Option<Optim<M, B>>,
    plan: Option<BucketPlan>,
    sums: Option<Sums<B::InnerBackend>>,
}

/// One device's thread: answers every message, in order. A panic inside becomes that
/// message's error.
fn worker_loop<B: TrainBackend, M: Replicable<B>>(ends: WorkerEnds<B, M>) {
    let WorkerEnds {
        i,
        rx,
        reply,
        device,
        mut exchange,
        style,
        wire,
        bucket_bytes,
    } = ends;
    let mut r = Replica::<B, M> {
        own: None,
        optim: None,
        plan: None,
        sums: None,
    };
    let guarded = |f: &mut dyn FnMut() -> Result<(), String>| {
        catch_unwind(AssertUnwindSafe(f))
            .map_err(panic_message)
            .and_then(|r| r)
    };
    let exchange_err = |e: ExchangeError| match e {
        ExchangeError::Aborted(why) => format!("{ABORTED}{why}"),
        ExchangeError::Failed(why) => why,
    };
    while let Ok(msg) = rx.recv() {
        let answer = match msg {
            Msg::Start(start) => {
                let (model, with_optim) = *start;
                let res = guarded(&mut || {
                    let mine = if i == 0 {
                        model.clone()
                    } else {
                        blank_on::<B, M>(&model, &device)
                    };
                    let shared = share_module::<B, M>(
                        exchange.as_mut(),
                        mine,
                        "the start (the main replica's weights)",
                    )
                    .map_err(exchange_err)?;
                    if i > 0 {
                        r.own = Some(shared);
                    }
                    if let Some((o, bytes)) = with_optim.clone() {
                        r.optim = Some(o.load_bytes(bytes, &device).map_err(|e| e.to_string())?);
                    }
                    Ok(())
                });
                Reply::Started(res)
            }
            Msg::Work(mut job) => {
                let mut worked = None;
                let res = guarded(&mut || {
                    worked = Some(
                        work::<B, M>(
                            i,
                            &mut job,
                            &mut r,
                            exchange.as_mut(),
                            &device,
                            style,
                            wire,
                            bucket_bytes,
                        )
                        .map_err(|e| match e {
                            WorkError::Exchange(e) => exchange_err(e),
                            WorkError::Other(m) => m,
                        })?,
                    );
                    Ok(())
                });
                Reply::Worked(res.and_then(|()| worked.take().ok_or_else(|| "no result".into())))
            }
            Msg::SyncBuffers(main, step) => {
                let mut synced = None;
                let during = format!("the BatchNorm statistics at step {step}");
                let res = guarded(&mut || {
                    let m = match (&main, &r.own) {
                        (Some(m), _) | (None, Some(m)) => m.clone(),
                        (None, None) => {
                            return Err("statistics before the replica was set up".into());
                        }
                    };
                    let m = mean_buffers::<B, M>(exchange.as_mut(), m, &during)
                        .map_err(exchange_err)?;
                    if i == 0 {
                        synced = Some(m);
                    } else {
                        r.own = Some(m);
                    }
                    Ok(())
                });
                Reply::Synced(res.map(|()| synced.take()))
            }
            Msg::Totals(reset) => {
                let mut totals = None;
                let res = guarded(&mut || {
                    totals = Some(read_totals(&mut r.sums, reset));
                    Ok(())
                });
                Reply::Totals(res.map(|()| totals.unwrap_or((0.0, 0.0, 0))))
            }
        };
        if reply.send((i, answer)).is_err() {
            return;
        }
    }
}

enum WorkError {
    Exchange(ExchangeError),
    Other(String),
}

/// One worker's part of a step. A replica's own model survives a failed step, so the
/// next step can run.
#[allow(clippy::too_many_arguments)]
fn work<B: TrainBackend, M: Replicable<B>>(
    i: usize,
    job: &mut Job<M>,
    r: &mut Replica<B, M>,
    exchange: &mut dyn Exchange<B::InnerBackend>,
    device: &B::Device,
    style: DataParallel,
    wire: Option<FloatDType>,
    bucket_bytes: usize,
) -> Result<Worked, WorkError> {
    fault_here(&job.input, i).map_err(WorkError::Other)?;
    let model = match job.model.take() {
        Some(m) => m,
        None => r
            .own
            .clone()
            .ok_or_else(|| WorkError::Other("work before the replica was set up".into()))?,
    };
    let during = format!("step {}", job.input.step);
    let model = if style == DataParallel::Dp && job.exchange {
        share_trainable::<B, M>(exchange, model, &during).map_err(WorkError::Exchange)?
    } else {
        model
    };
    let plan = r
        .plan
        .get_or_insert_with(|| BucketPlan::new(&model, bucket_bytes, wire));
    let mut times = StepTimes::default();
    let micros = std::mem::take(&mut job.micros);
    let (grads, sums) = replica_grads::<B, M>(
        &model,
        micros,
        job.global,
        job.label_smoothing,
        job.input.scale,
        device,
        job.exchange
            .then_some((exchange as &mut dyn Exchange<B::InnerBackend>, &*plan)),
        &during,
        job.timed.then_some(&mut times),
    )
    .map_err(WorkError::Exchange)?;
    r.sums = Sums::accumulate(r.sums.take(), sums);
    if i == 0 {
        return Ok(Worked {
            grads: Some(grads),
            times,
        });
    }
    r.own = Some(match (style, r.optim.as_mut()) {
        (DataParallel::Ddp, Some(o)) => {
            // Every replica sees the same sum, so it skips an overflowed step too.
            apply_clipped(model, o, grads, job.input.lr, job.clip, job.input.scale).0
        }
        _ => model,
    });
    Ok(Worked { grads: None, times })
}

/// A module of `model`'s structure (same parameter ids) on `device`, of zeros, with its
/// own BatchNorm running statistics (not shared with `model`'s, unlike `Clone`): what
/// a broadcast then fills.
fn blank_on<B: TrainBackend, M: Replicable<B>>(model: &M, device: &B::Device) -> M {
    struct Zeros<'a, B: TrainBackend>(&'a B::Device);
    impl<B: TrainBackend> ModuleMapper<B> for Zeros<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (require_grad, dims) = {
                let t = param.val();
                (t.is_require_grad(), t.dims())
            };
            let (id, _, mapper) = param.consume();
            let t = Tensor::<B, D>::zeros(dims, self.0).set_require_grad(require_grad);
            Param::from_mapped_value(id, t, mapper)
        }
    }
    // `from_inner` makes new running-statistics cells.
    M::from_inner(model.valid()).map(&mut Zeros::<B>(device))
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::model::{Classifier, ModelSpec, ResNet};
    use crate::test_util::{TestBackend, device, max_diff, rng_lock};
    use crate::train::exchange::{Engine, for_threads};
    use burn::module::{AutodiffModule, Module, ModuleVisitor};
    use burn::nn::conv::{Conv2d, Conv2dConfig};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Distribution;
    use burn::tensor::backend::Backend;

    /// Workers on `n` replicas sharing the CPU, exchanging through host memory.
    fn replicas<M: Replicable<TestBackend>>(n: usize, cfg: &Config) -> Replicas<TestBackend, M> {
        let devices = vec![device(); n];
        let names: Vec<String> = (0..n).map(|i| format!("cpu#{i}")).collect();
        let (exchanges, aborter, board) = for_threads(&Engine::Host, &devices).unwrap();
        Replicas::new(
            &devices,
            &names,
            &[],
            cfg.parallel.strategy,
            &cfg.train,
            ThreadExchanges {
                exchanges,
                aborter,
                board,
                engine: "host memory".into(),
                wire: None,
                bucket_bytes: (cfg.parallel.bucket_mib as usize) << 20,
            },
        )
    }

    fn input(step: u64, lr: f64) -> StepInput {
        StepInput {
            step,
            lr,
            scale: None,
            fault: None,
            stop_asked: false,
        }
    }

    /// BatchNorm's running statistics of `model`, pending updates included.
    fn buffers<M: AutodiffModule<TestBackend>>(model: &M) -> Vec<f32> {
        struct Collect(Vec<f32>);
        impl<B: Backend> ModuleVisitor<B> for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                let t = p.val();
                if !t.is_require_grad() {
                    self.0.extend(t.into_data().to_vec::<f32>().unwrap());
                }
            }
        }
        let _ = model.valid();
        let mut c = Collect(Vec::new());
        model.visit(&mut c);
        c.0
    }

    /// A small convnet without BatchNorm: data parallelism must match one device exactly
    /// up to float rounding.
    #[derive(Module, Debug)]
    struct NoBn<B: Backend> {
        conv: Conv2d<B>,
        fc: Linear<B>,
    }

    impl<B: Backend> Classifier<B> for NoBn<B> {
        fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
            let x = burn::tensor::activation::relu(self.conv.forward(x)); // [N, 4, 6, 6]
            self.fc.forward(x.flatten(1, 3))
        }
    }

    fn batch(n: usize) -> Batch {
        let images: Tensor<TestBackend, 4> =
            Tensor::random([n, 3, 6, 6], Distribution::Normal(0.0, 1.0), &device());
        Batch {
            images: images.into_data().to_vec::<f32>().unwrap(),
            labels: (0..n).map(|i| (i % 3) as i64).collect(),
            shape: [n, 3, 6, 6],
        }
    }

    /// The trainable parameters (BatchNorm's running statistics excluded).
    fn params<M: Module<TestBackend>>(m: &M) -> Vec<f32> {
        struct Collect(Vec<f32>);
        impl<B: Backend> ModuleVisitor<B> for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                let t = p.val();
                if t.is_require_grad() {
                    self.0.extend(t.into_data().to_vec::<f32>().unwrap());
                }
            }
        }
        let mut c = Collect(Vec::new());
        m.visit(&mut c);
        c.0
    }

    /// Trains `init` for `steps` steps on `n` replicas sharing the CPU device.
    fn train_on<M: Replicable<TestBackend>>(
        init: &M,
        batches: &[Batch],
        n: usize,
        cfg: &Config,
    ) -> M {
        let mut optim = Optim::<M, TestBackend>::new(&cfg.optim);
        let mut model = init.clone();
        if n == 1 {
            for b in batches {
                model = crate::train::step::train_step(
                    model,
                    &mut optim,
                    b.clone(),
                    0.05,
                    &cfg.train,
                    &device(),
                    None,
                )
                .0;
            }
            return model;
        }
        let mut r = replicas::<M>(n, cfg);
        steps(&mut r, model, &mut optim, batches)
    }

    /// One data-parallel step per batch, at a fixed learning rate.
    fn steps<M: Replicable<TestBackend>>(
        r: &mut Replicas<TestBackend, M>,
        mut model: M,
        optim: &mut Optim<M, TestBackend>,
        batches: &[Batch],
    ) -> M {
        if !r.started {
            model = r.start(model, optim).unwrap();
        }
        let watchdog = Watchdog::idle();
        for (s, b) in batches.iter().enumerate() {
            model = r
                .step(model, optim, b.clone(), &input(s as u64, 0.05), &watchdog)
                .unwrap()
                .model;
        }
        model
    }

    #[test]
    fn replicas_without_batchnorm_match_one_device() {
        let _rng = rng_lock();
        TestBackend::seed(&device(), 3);
        let init = crate::model::materialize(NoBn::<TestBackend> {
            conv: Conv2dConfig::new([3, 4], [1, 1]).init(&device()),
            fc: LinearConfig::new(4 * 36, 3).init(&device()),
        });
        let batches: Vec<Batch> = (0..4).map(|_| batch(12)).collect();
        let mut cfg = Config::default();
        cfg.optim.weight_decay = 1e-3;
        cfg.optim.momentum = 0.9;
        let one = params(&train_on(&init, &batches, 1, &cfg));
        for strategy in [DataParallel::Dp, DataParallel::Ddp] {
            cfg.parallel.strategy = strategy;
            for n in [2, 3, 4, 8] {
                let many = params(&train_on(&init, &batches, n, &cfg));
                assert!(
                    max_diff(&one, &many) < 1e-5,
                    "{n} replicas ({strategy:?}) differ by {}",
                    max_diff(&one, &many)
                );
            }
        }
        assert!(
            max_diff(&one, &params(&init)) > 1e-3,
            "training should have moved the weights"
        );
    }

    #[test]
    fn a_paused_exchange_leaves_the_main_replica_its_own_gradients() {
        let _rng = rng_lock();
        TestBackend::seed(&device(), 5);
        let init = crate::model::materialize(NoBn::<TestBackend> {
            conv: Conv2dConfig::new([3, 4], [1, 1]).init(&device()),
            fc: LinearConfig::new(4 * 36, 3).init(&device()),
        });
        let b = batch(12);
        let mut cfg = Config::default();
        cfg.optim.weight_decay = 0.0;
        cfg.optim.momentum = 0.0;
        // Apart, the main replica steps on its half of the batch, weighted as half of
        // the global batch: one device on that half at half the learning rate.
        let half = b.clone().split(&[6, 6]).remove(0);
        let mut optim = Optim::<NoBn<TestBackend>, TestBackend>::new(&cfg.optim);
        let alone = crate::train::step::train_step(
            init.clone(),
            &mut optim,
            half,
            0.025,
            &cfg.train,
            &device(),
            None,
        )
        .0;
        let mut r = replicas::<NoBn<TestBackend>>(2, &cfg);
        r.exchange_gradients(false);
        let mut optim = Optim::<NoBn<TestBackend>, TestBackend>::new(&cfg.optim);
        let apart = steps(&mut r, init.clone(), &mut optim, std::slice::from_ref(&b));
        assert!(
            max_diff(&params(&alone), &params(&apart)) < 1e-5,
            "apart: {}",
            max_diff(&params(&alone), &params(&apart))
        );
        // Back on (every replica started again from the same weights), the step is
        // the whole batch's.
        r.exchange_gradients(true);
        r.started = false;
        let mut optim = Optim::<NoBn<TestBackend>, TestBackend>::new(&cfg.optim);
        let together = steps(&mut r, init.clone(), &mut optim, std::slice::from_ref(&b));
        let one = params(&train_on(&init, std::slice::from_ref(&b), 1, &cfg));
        assert!(max_diff(&one, &params(&together)) < 1e-5);
        assert!(max_diff(&one, &params(&apart)) > 1e-4);
    }

    /// Learnable images: the synthetic dataset, so gradients carry signal, not noise.
    fn learnable_batches(n: usize, steps: usize) -> Vec<Batch> {
        let mut cfg = Config::default();
        cfg.data.dataset = crate::config::DatasetKind::Synthetic;
        cfg.data.image_size = 8;
        cfg.data.synthetic_classes = 3;
        cfg.data.synthetic_train_size = n * steps;
        let data = crate::data::open(&cfg.data, 0).unwrap();
        let (train, _) = data.loaders(&cfg.data, n, 0);
        train.epoch(0, 0).map(Result::unwrap).collect()
    }

    fn tiny_resnet() -> ResNet<TestBackend> {
        ModelSpec::new(
            crate::config::Arch::Tiny,
            crate::config::Stem::Small,
            3,
            3,
            8,
        )
        .init(&device())
    }

    #[test]
    fn replicas_of_the_resnet_equal_one_device_with_one_micro_batch_per_replica() {
        // With BatchNorm each shard is normalised with its own statistics: exactly what
        // one device computes with a micro-batch per shard (gradient accumulation).
        let _rng = rng_lock();
        TestBackend::seed(&device(), 5);
        let init = tiny_resnet();
        let batches = learnable_batches(48, 3);
        for (n, strategy) in [
            (2, DataParallel::Dp),
            (3, DataParallel::Dp),
            (4, DataParallel::Dp),
            (3, DataParallel::Ddp),
        ] {
            let mut accum = Config::default();
            accum.train.grad_accum_steps = n;
            let one = params(&train_on(&init, &batches, 1, &accum));
            let mut cfg = Config::default();
            cfg.parallel.strategy = strategy;
            // A bucket per tensor on 2 replicas, one bucket for the whole model above.
            cfg.parallel.bucket_mib = if n == 2 { 0 } else { 1 };
            let many = params(&train_on(&init, &batches, n, &cfg));
            let d = max_diff(&one, &many);
            assert!(
                d < 1e-4,
                "{n} replicas ({strategy:?}) vs {n} micro-batches differ by {d}"
            );
        }
    }

    #[test]
    fn replicas_of_the_resnet_stay_close_to_one_device() {
        let _rng = rng_lock();
        TestBackend::seed(&device(), 5);
        let init = tiny_resnet();
        let batches = learnable_batches(64, 3);
        let cfg = Config::default();
        let start = params(&init);
        let one = params(&train_on(&init, &batches, 1, &cfg));
        let norm = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        let moved = norm(&one, &start);
        for n in [2, 3] {
            let many = params(&train_on(&init, &batches, n, &cfg));
            // Per-shard batch statistics make the runs only close: compare the
            // difference with how far training moved the weights.
            let rel = norm(&one, &many) / moved;
            eprintln!("{n} replicas: relative difference {rel:.4}");
            assert!(rel < 0.25, "{n} replicas differ by {rel:.3} of the update");
        }
    }

    #[test]
    fn running_statistics_are_the_same_on_every_replica_after_a_sync() {
        let _rng = rng_lock();
        TestBackend::seed(&device(), 7);
        let mut model = tiny_resnet();
        let batches = learnable_batches(24, 2);
        for strategy in [DataParallel::Dp, DataParallel::Ddp] {
            let mut cfg = Config::default();
            cfg.parallel.strategy = strategy;
            let mut r = replicas::<ResNet<TestBackend>>(3, &cfg);
            let mut optim = Optim::new(&cfg.optim);
            let before = buffers(&model);
            model = steps(&mut r, model, &mut optim, &batches);
            model = r.sync_buffers(model, 2).unwrap();
            let once = buffers(&model);
            assert_ne!(once, before, "training should move the statistics");
            // A second sync averages identical copies: nothing changes.
            model = r.sync_buffers(model, 3).unwrap();
            assert_eq!(buffers(&model), once, "{strategy:?}");
        }
    }

    /// Records which `StreamId` each replica thread runs its forward pass under.
    #[derive(Module, Debug)]
    struct StreamSpy<B: Backend> {
        inner: NoBn<B>,
    }

    static SEEN: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());

    impl<B: Backend> Classifier<B> for StreamSpy<B> {
        fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
            let thread = std::thread::current().name().unwrap_or("").to_string();
            SEEN.lock()
                .unwrap()
                .push((thread, StreamId::current().value));
            self.inner.forward(x)
        }
    }

    #[test]
    fn the_main_replica_queues_on_the_main_threads_stream_and_the_others_on_their_own() {
        let _rng = rng_lock();
        let model = crate::model::materialize(StreamSpy::<TestBackend> {
            inner: NoBn {
                conv: Conv2dConfig::new([3, 4], [1, 1]).init(&device()),
                fc: LinearConfig::new(4 * 36, 3).init(&device()),
            },
        });
        let cfg = Config::default();
        let mut r = replicas::<StreamSpy<TestBackend>>(2, &cfg);
        let mut optim = Optim::new(&cfg.optim);
        SEEN.lock().unwrap().clear();
        steps(&mut r, model, &mut optim, &[batch(6), batch(6)]);
        let main = StreamId::current().value;
        let seen = SEEN.lock().unwrap().clone();
        let on = |name: &str| -> Vec<u64> {
            seen.iter()
                .filter(|(t, _)| t == name)
                .map(|(_, s)| *s)
                .collect()
        };
        assert_eq!(on("kiln-replica-0"), vec![main, main], "{seen:?}");
        let other = on("kiln-replica-1");
        assert_eq!(other.len(), 2, "{seen:?}");
        assert!(other.iter().all(|s| *s != main), "{seen:?}");
    }

    /// Panics in forward when its shard holds a NaN: a replica that fails.
    #[derive(Module, Debug)]
    struct Fragile<B: Backend> {
        inner: NoBn<B>,
    }

    impl<B: Backend> Classifier<B> for Fragile<B> {
        fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
            if x.clone().sum().into_scalar().elem::<f64>().is_nan() {
                panic!("simulated device fault");
            }
            self.inner.forward(x)
        }
    }

    use burn::tensor::ElementConversion;

    #[test]
    fn a_failing_replica_fails_the_step_naming_the_device() {
        failing_replica(DataParallel::Dp);
        failing_replica(DataParallel::Ddp);
    }

    fn failing_replica(strategy: DataParallel) {
        let _rng = rng_lock();
        let model = crate::model::materialize(Fragile::<TestBackend> {
            inner: NoBn {
                conv: Conv2dConfig::new([3, 4], [1, 1]).init(&device()),
                fc: LinearConfig::new(4 * 36, 3).init(&device()),
            },
        });
        let mut b = batch(6);
        // Poison the last two images: they land on the third replica.
        let per = 3 * 6 * 6;
        for v in &mut b.images[4 * per..] {
            *v = f32::NAN;
        }
        let mut cfg = Config::default();
        cfg.parallel.strategy = strategy;
        let mut r = replicas::<Fragile<TestBackend>>(3, &cfg);
        let mut optim = Optim::new(&cfg.optim);
        let model = r.start(model, &optim).unwrap();
        let watchdog = Watchdog::idle();
        let err = r
            .step(model.clone(), &mut optim, b, &input(7, 0.1), &watchdog)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("cpu#2")
                && err.contains("step 7")
                && err.contains("simulated device fault"),
            "{err}"
        );
        // The replicas are still usable afterwards.
        let ok = r.step(model, &mut optim, batch(6), &input(8, 0.1), &watchdog);
        assert!(ok.is_ok(), "{:?}", ok.err());
    }
}
