//! The data-parallel learner. Every global batch is split into one shard per device
//! (sizes follow the device weights, never empty); one long-lived worker thread per
//! device runs forward and backward on its shard with the loss scaled by shard/global
//! size and hands its gradients to the main thread, which sums them in device order,
//! so the update equals single-device training on the whole batch. The main device's
//! worker trains the main model itself; every other worker keeps a replica on its own
//! device. All traffic between devices goes through host memory (see `transfer`).
//!
//! `train.strategy = "dp"` ("DataParallel"): one optimizer step on the main device,
//! the new weights copied to the replicas before the next step. `"ddp"`: every replica
//! keeps an optimizer too; the summed gradients go to each device right after the sum
//! and every replica takes the same step on the same numbers, beside the main one (an
//! all-reduce as reduce-then-broadcast: Burn 0.21's collectives need its `distributed`
//! feature, which stops the CPU backend from training in the same binary).
//!
//! BatchNorm normalises each shard with its own batch statistics. Each replica keeps
//! an exponential average of its own shards' statistics; since that average is linear,
//! the mean of the replicas' averages equals the average of the mean statistics, so
//! [`Replicas::sync_buffers`] (before every evaluation and checkpoint) makes them
//! identical everywhere without exchanging them every step.
//!
//! A replica that fails (an error or a panic on its thread) makes the step fail with an
//! error naming the device; the other replicas finish their shards, so nothing hangs
//! waiting for it.

use crate::ops::SgdBackend;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::ops::UploadBackend;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::optim::Optim;
use super::step::{Sums, apply, apply_clipped, forward_backward, micro_batches};
use super::transfer::{self, Buckets, DeviceGrads, Flat, HostGrads, Part};
use crate::config::{FaultKind, Strategy, TrainConfig};
use crate::data::Batch;
use crate::model::Classifier;

/// Shard sizes for `n` images over devices with relative `weights`: proportional,
/// largest remainders first, every shard at least one image. `None` when `n` is smaller
/// than the number of devices.
pub fn shard_sizes(n: usize, weights: &[f64]) -> Option<Vec<usize>> {
    let k = weights.len();
    if k == 0 || n < k {
        return None;
    }
    let total: f64 = weights.iter().sum();
    // One image each first, the rest by weight.
    let rest = (n - k) as f64;
    let ideal: Vec<f64> = weights.iter().map(|w| rest * w / total).collect();
    let mut sizes: Vec<usize> = ideal.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut left = n - sizes.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| {
        (ideal[b] - ideal[b].floor())
            .total_cmp(&(ideal[a] - ideal[a].floor()))
            .then(a.cmp(&b))
    });
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        sizes[i] += 1;
        left -= 1;
    }
    Some(sizes)
}

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica on {device} failed at step {step}: {message}")]
    Failed {
        device: String,
        /// Position of the device among those used.
        position: usize,
        step: u64,
        message: String,
    },
    #[error(
        "train.batch_size / train.grad_accum_steps = {micro} images cannot be split over {devices} devices"
    )]
    TooSmall { micro: usize, devices: usize },
}

struct Job<M> {
    /// The main model, for the main device's worker; `None`: the worker's own replica.
    model: Option<M>,
    shard: Batch,
    weight: f64,
    label_smoothing: f64,
    /// Read the gradients back to host memory (every worker but the main device's;
    /// all of them for `ddp`, whose sum is made on the host).
    to_host: bool,
    /// An injected fault this job must act out (`[faults]`).
    fault: Option<FaultKind>,
}

/// One worker's gradients: in place on the main device, or read back to the host.
enum Grads {
    Local(GradientsParams),
    Host(HostGrads),
}

type Reply<B> = (
    usize,
    Result<(Grads, Sums<<B as AutodiffBackend>::InnerBackend>), String>,
    f64,
);

type BufferReply = (usize, Result<Flat, String>);

/// Set-up of a replica: the main model (on the main device) and, for `ddp`, the main
/// optimizer with its state serialised (to be read onto the replica's device).
type Init<B, M> = Box<(M, Option<(Optim<M, B>, Vec<u8>)>)>;

enum Msg<B: AutodiffBackend, M: AutodiffModule<B>> {
    Init(Init<B, M>),
    /// `dp`: the main model's new trainable weights.
    Weights(Arc<Flat>),
    /// `ddp`: the summed gradients of the step just taken.
    Update {
        grads: HostGrads,
        lr: f64,
        clip: f64,
        /// fp16's loss scale, to divide the gradients by.
        scale: Option<f64>,
    },
    /// Reply with the replica's BatchNorm running statistics.
    ReadBuffers,
    /// Take these running statistics.
    SetBuffers(Arc<Flat>),
    Work(Job<M>),
}

struct Worker<B: AutodiffBackend, M: AutodiffModule<B>> {
    name: String,
    jobs: Sender<Msg<B, M>>,
    handle: JoinHandle<()>,
    /// Holds its own replica (every worker but the main device's, once set up).
    initialized: bool,
}

/// Per-device work in the current reporting window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceLoad {
    pub name: String,
    pub images: usize,
    pub steps: usize,
    /// Wall time of the device's jobs (weights in, forward, backward, gradients out).
    pub busy_s: f64,
}

/// The worker threads of a data-parallel run; one per device, `devices[0]` the main one.
pub struct Replicas<B: AutodiffBackend, M: AutodiffModule<B>> {
    strategy: Strategy,
    buckets: Buckets,
    main: B::Device,
    workers: Vec<Worker<B, M>>,
    replies: Receiver<Reply<B>>,
    buffer_replies: Receiver<BufferReply>,
    weights: Vec<f64>,
    load: Vec<DeviceLoad>,
    /// Which devices the current step still waits for.
    pending: Arc<Mutex<Vec<bool>>>,
}

impl<
    B: AutodiffBackend<InnerBackend: SgdBackend> + UploadBackend,
    M: Classifier<B> + AutodiffModule<B> + 'static,
> Replicas<B, M>
{
    pub fn start(
        devices: &[B::Device],
        names: &[String],
        weights: &[f64],
        strategy: Strategy,
        buckets: Buckets,
    ) -> Self {
        let main = devices[0].clone();
        let (reply_tx, replies) = channel::<Reply<B>>();
        let (buffer_tx, buffer_replies) = channel::<BufferReply>();
        let workers = devices
            .iter()
            .enumerate()
            .map(|(i, device)| {
                let (jobs, rx) = channel::<Msg<B, M>>();
                let ends = WorkerEnds {
                    i,
                    rx,
                    reply: reply_tx.clone(),
                    buffers: buffer_tx.clone(),
                    device: device.clone(),
                    main: main.clone(),
                    buckets,
                };
                let handle = std::thread::Builder::new()
                    .name(format!("kiln-replica-{i}"))
                    .spawn(move || worker_loop::<B, M>(ends))
                    .expect("spawning a replica thread should succeed");
                Worker {
                    name: names
                        .get(i)
                        .cloned()
                        .unwrap_or_else(|| format!("device {i}")),
                    jobs,
                    handle,
                    initialized: false,
                }
            })
            .collect();
        let weights = if weights.len() == devices.len() {
            weights.to_vec()
        } else {
            vec![1.0; devices.len()]
        };
        let load = names
            .iter()
            .map(|n| DeviceLoad {
                name: n.clone(),
                ..DeviceLoad::default()
            })
            .collect();
        Replicas {
            strategy,
            buckets,
            main,
            pending: Arc::new(Mutex::new(vec![false; devices.len()])),
            workers,
            replies,
            buffer_replies,
            weights,
            load,
        }
    }

    fn send(&self, i: usize, msg: Msg<B, M>, step: u64) -> Result<(), ReplicaError> {
        self.workers[i]
            .jobs
            .send(msg)
            .map_err(|_| self.failed(i, step, "its thread has exited".into()))
    }

    /// Brings every other replica to the main model's weights: set up once, then (`dp`)
    /// the new weights before each step. `ddp` replicas update themselves.
    fn prepare(&mut self, model: &M, optim: &Optim<M, B>, step: u64) -> Result<(), ReplicaError> {
        let mut weights: Option<Arc<Flat>> = None;
        // Serialised once, however many replicas are set up.
        let mut state: Option<Vec<u8>> = None;
        for i in 1..self.workers.len() {
            if !self.workers[i].initialized {
                let optim = match self.strategy {
                    Strategy::Dp => None,
                    Strategy::Ddp => {
                        let bytes = match &state {
                            Some(b) => b.clone(),
                            None => {
                                let b = optim.to_bytes().map_err(|e| {
                                    self.failed(
                                        i,
                                        step,
                                        format!("copying the optimizer state: {e}"),
                                    )
                                })?;
                                state.insert(b).clone()
                            }
                        };
                        Some((optim.clone(), bytes))
                    }
                };
                self.send(i, Msg::Init(Box::new((model.clone(), optim))), step)?;
                self.workers[i].initialized = true;
            } else if self.strategy == Strategy::Dp {
                let w = weights
                    .get_or_insert_with(|| {
                        Arc::new(transfer::snapshot(model, Part::Trainable, self.buckets))
                    })
                    .clone();
                self.send(i, Msg::Weights(w), step)?;
            }
        }
        Ok(())
    }

    /// One optimizer step on `batch` over all devices; `fault` makes the device at that
    /// position act out an injected fault.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        model: M,
        optim: &mut Optim<M, B>,
        batch: Batch,
        lr: f64,
        cfg: &TrainConfig,
        step: u64,
        fault: Option<(usize, FaultKind)>,
        scale: Option<f64>,
    ) -> Result<(M, Sums<B::InnerBackend>, bool), ReplicaError> {
        let total = batch.labels.len() as f64;
        // `ddp` all-reduces through host memory: every replica reads its gradients back
        // at once, the host sums them, every replica uploads the sum at once; two copies
        // on the critical path instead of four for a sum made on the main device.
        let host_sum = self.strategy == Strategy::Ddp && self.workers.len() > 1;
        self.prepare(&model, optim, step)?;
        // Kept in device order and summed in that order, whatever order the replies
        // come in: float addition is not associative, and runs must repeat exactly.
        let mut parts: Vec<Grads> = Vec::new();
        let mut sums = None;
        for micro in micro_batches(batch, cfg) {
            let n = micro.labels.len();
            let sizes = shard_sizes(n, &self.weights).ok_or(ReplicaError::TooSmall {
                micro: n,
                devices: self.workers.len(),
            })?;
            for (i, shard) in micro.split(&sizes).into_iter().enumerate() {
                let job = Job {
                    model: (i == 0).then(|| model.clone()),
                    weight: shard.labels.len() as f64 / total * scale.unwrap_or(1.0),
                    shard,
                    label_smoothing: cfg.label_smoothing,
                    to_host: i > 0 || host_sum,
                    fault: fault.filter(|(p, _)| *p == i).map(|(_, k)| k),
                };
                self.load[i].images += sizes[i];
                self.send(i, Msg::Work(job), step)?;
            }
            let mut waiting: Vec<bool> = vec![true; self.workers.len()];
            let mut replies: Vec<Option<(Grads, Sums<B::InnerBackend>)>> =
                (0..self.workers.len()).map(|_| None).collect();
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .fill(true);
            let mut first_error = None;
            while waiting.iter().any(|w| *w) {
                match self.replies.recv_timeout(Duration::from_millis(500)) {
                    Ok((i, out, secs)) => {
                        waiting[i] = false;
                        self.pending.lock().unwrap_or_else(|e| e.into_inner())[i] = false;
                        self.load[i].busy_s += secs;
                        match out {
                            Ok(reply) => replies[i] = Some(reply),
                            Err(msg) => {
                                first_error.get_or_insert((i, msg));
                            }
                        }
                    }
                    Err(_) => {
                        // A worker that died without replying would otherwise be waited for forever.
                        if let Some(i) = (0..self.workers.len())
                            .find(|&i| waiting[i] && self.workers[i].handle.is_finished())
                        {
                            return Err(self.failed(
                                i,
                                step,
                                "its thread stopped without a reply".into(),
                            ));
                        }
                    }
                }
            }
            if let Some((i, msg)) = first_error {
                return Err(self.failed(i, step, msg));
            }
            for (g, s) in replies.into_iter().flatten() {
                parts.push(g);
                sums = Sums::accumulate(sums, s);
            }
        }
        for l in &mut self.load {
            l.steps += 1;
        }
        let grads = if host_sum {
            let host: Vec<HostGrads> = parts
                .into_iter()
                .filter_map(|g| match g {
                    Grads::Host(h) => Some(h),
                    Grads::Local(_) => None,
                })
                .collect();
            let sum = HostGrads::sum(&host).ok_or_else(|| {
                self.failed(
                    0,
                    step,
                    "the replicas returned gradients of different parameters".into(),
                )
            })?;
            // The other replicas upload the sum and step beside the main one.
            for i in 1..self.workers.len() {
                // Every replica sees the same sum, so it skips an overflowed step too.
                let update = Msg::Update {
                    grads: sum.clone(),
                    lr,
                    clip: cfg.grad_clip_norm,
                    scale,
                };
                self.send(i, update, step)?;
            }
            sum.into_params(&model, &self.main)
        } else {
            let mut parts: Vec<Summand<B>> = parts
                .into_iter()
                .map(|g| match g {
                    Grads::Local(g) => Summand::Local(g),
                    Grads::Host(h) => Summand::Uploaded(h.upload(&self.main)),
                })
                .collect();
            let mut sum = SumGrads::<B> {
                parts: &mut parts,
                out: GradientsParams::new(),
            };
            model.visit(&mut sum);
            sum.out
        };
        let sums = sums.expect("every step has at least one shard");
        let (model, stepped) = apply(model, optim, grads, lr, cfg, scale);
        Ok((model, sums, stepped))
    }

    /// Makes BatchNorm's running statistics the mean over all replicas, everywhere;
    /// call before evaluating or saving `model`.
    pub fn sync_buffers(&mut self, model: M, step: u64) -> Result<M, ReplicaError> {
        let others: Vec<usize> = (1..self.workers.len())
            .filter(|&i| self.workers[i].initialized)
            .collect();
        if others.is_empty() {
            return Ok(model);
        }
        for &i in &others {
            self.send(i, Msg::ReadBuffers, step)?;
        }
        let mut all: Vec<Option<Flat>> = vec![None; self.workers.len()];
        all[0] = Some(transfer::buffers(&model, self.buckets));
        let mut left = others.len();
        while left > 0 {
            match self.buffer_replies.recv_timeout(Duration::from_millis(500)) {
                Ok((i, Ok(b))) => {
                    all[i] = Some(b);
                    left -= 1;
                }
                Ok((i, Err(msg))) => return Err(self.failed(i, step, msg)),
                Err(_) => {
                    if let Some(&i) = others
                        .iter()
                        .find(|&&i| all[i].is_none() && self.workers[i].handle.is_finished())
                    {
                        return Err(self.failed(
                            i,
                            step,
                            "its thread stopped without a reply".into(),
                        ));
                    }
                }
            }
        }
        let mean = Arc::new(transfer::mean(
            &all.into_iter().flatten().collect::<Vec<_>>(),
        ));
        for &i in &others {
            self.send(i, Msg::SetBuffers(mean.clone()), step)?;
        }
        Ok(transfer::load(model, &mean, Part::Buffers, &self.main))
    }

    fn failed(&self, i: usize, step: u64, message: String) -> ReplicaError {
        ReplicaError::Failed {
            device: self.workers[i].name.clone(),
            position: i,
            step,
            message,
        }
    }

    /// For the watchdog: the first device the current step still waits for.
    pub fn pending_probe(&self) -> super::watchdog::Pending {
        let pending = self.pending.clone();
        let names: Vec<String> = self.workers.iter().map(|w| w.name.clone()).collect();
        Box::new(move || {
            let p = pending.lock().unwrap_or_else(|e| e.into_inner());
            p.iter().position(|w| *w).map(|i| (i, names[i].clone()))
        })
    }

    /// Per-device work since the last call, and resets it.
    pub fn take_load(&mut self) -> Vec<DeviceLoad> {
        self.load
            .iter_mut()
            .map(|l| {
                let out = l.clone();
                *l = DeviceLoad {
                    name: l.name.clone(),
                    ..DeviceLoad::default()
                };
                out
            })
            .collect()
    }
}

/// What a worker thread holds of the learner.
struct WorkerEnds<B: AutodiffBackend, M: AutodiffModule<B>> {
    i: usize,
    rx: Receiver<Msg<B, M>>,
    reply: Sender<Reply<B>>,
    buffers: Sender<BufferReply>,
    device: B::Device,
    main: B::Device,
    buckets: Buckets,
}

/// One device's thread. Replies to every `Work` and `ReadBuffers`, in order; a failure
/// in a message nobody waits for is reported with the next reply.
fn worker_loop<
    B: AutodiffBackend<InnerBackend: SgdBackend> + UploadBackend,
    M: Classifier<B> + AutodiffModule<B>,
>(
    ends: WorkerEnds<B, M>,
) {
    let WorkerEnds {
        i,
        rx,
        reply,
        buffers,
        device,
        main,
        buckets,
    } = ends;
    let mut own: Option<M> = None;
    let mut optim: Option<Optim<M, B>> = None;
    let mut broken: Option<String> = None;
    let mut other_s = 0.0;
    let guarded = |f: &mut dyn FnMut() -> Result<(), String>| {
        catch_unwind(AssertUnwindSafe(f))
            .map_err(panic_message)
            .and_then(|r| r)
    };
    while let Ok(msg) = rx.recv() {
        let t = Instant::now();
        match msg {
            Msg::Work(mut job) => {
                let out = match broken.clone() {
                    Some(msg) => Err(msg),
                    None => {
                        let model = job.model.take().or_else(|| own.clone());
                        let mut out = None;
                        let r = guarded(&mut || {
                            let model = model
                                .clone()
                                .ok_or_else(|| "work before the replica was set up".to_string())?;
                            out = Some(run_job::<B, M>(
                                &mut job,
                                model,
                                &device,
                                &main,
                                i > 0,
                                buckets,
                            )?);
                            Ok(())
                        });
                        r.and_then(|()| out.ok_or_else(|| "no result".to_string()))
                    }
                };
                let secs = t.elapsed().as_secs_f64() + std::mem::take(&mut other_s);
                if reply.send((i, out, secs)).is_err() {
                    return;
                }
                continue;
            }
            Msg::ReadBuffers => {
                let out = match (&broken, &own) {
                    (Some(msg), _) => Err(msg.clone()),
                    (None, None) => Err("no replica to read".into()),
                    (None, Some(m)) => {
                        let mut data = None;
                        guarded(&mut || {
                            data = Some(transfer::buffers(m, buckets));
                            Ok(())
                        })
                        .and_then(|()| data.ok_or_else(|| "no statistics".to_string()))
                    }
                };
                if buffers.send((i, out)).is_err() {
                    return;
                }
                continue;
            }
            _ if broken.is_some() => continue,
            Msg::Init(init) => {
                let (model, mut with_optim) = *init;
                let r = guarded(&mut || {
                    own = Some(transfer::replica(&model, &device, buckets));
                    if let Some((o, bytes)) = with_optim.take() {
                        optim = Some(o.load_bytes(bytes, &device).map_err(|e| e.to_string())?);
                    }
                    Ok(())
                });
                broken = r.err();
            }
            Msg::Weights(w) => {
                let r = guarded(&mut || {
                    let m = own.take().ok_or("weights before the replica was set up")?;
                    own = Some(transfer::load(m, &w, Part::Trainable, &device));
                    Ok(())
                });
                broken = r.err();
            }
            Msg::SetBuffers(b) => {
                let r = guarded(&mut || {
                    let m = own
                        .take()
                        .ok_or("statistics before the replica was set up")?;
                    own = Some(transfer::load(m, &b, Part::Buffers, &device));
                    Ok(())
                });
                broken = r.err();
            }
            Msg::Update {
                grads,
                lr,
                clip,
                scale,
            } => {
                let mut grads = Some(grads);
                let r = guarded(&mut || {
                    let (m, o) = match (own.take(), optim.as_mut()) {
                        (Some(m), Some(o)) => (m, o),
                        _ => return Err("an update before the replica was set up".into()),
                    };
                    let g = grads
                        .take()
                        .ok_or("update applied twice")?
                        .into_params(&m, &device);
                    own = Some(apply_clipped(m, o, g, lr, clip, scale).0);
                    Ok(())
                });
                broken = r.err();
            }
        }
        other_s += t.elapsed().as_secs_f64();
    }
}

fn run_job<
    B: AutodiffBackend<InnerBackend: SgdBackend> + UploadBackend,
    M: Classifier<B> + AutodiffModule<B>,
>(
    job: &mut Job<M>,
    model: M,
    device: &B::Device,
    main: &B::Device,
    remote: bool,
    buckets: Buckets,
) -> Result<(Grads, Sums<B::InnerBackend>), String> {
    if let Some(kind) = job.fault {
        act_out(kind)?;
    }
    let shard = std::mem::replace(
        &mut job.shard,
        Batch {
            images: Vec::new(),
            labels: Vec::new(),
            shape: [0; 4],
        },
    );
    let (grads, sums) = forward_backward(&model, shard, device, job.weight, job.label_smoothing);
    // Reading back finishes this device's work here, so its time is measured and
    // errors surface on this thread, naming this device.
    let grads = if job.to_host {
        Grads::Host(HostGrads::read(grads, &model, buckets))
    } else {
        Grads::Local(grads)
    };
    let sums = if remote { sums.via_host(main) } else { sums };
    let out = (grads, sums);
    B::sync(device).map_err(|e| format!("{e:?}"))?;
    Ok(out)
}

/// Does what an injected fault of `kind` stands for, on the calling thread.
pub fn act_out(kind: FaultKind) -> Result<(), String> {
    match kind {
        FaultKind::None => Ok(()),
        FaultKind::Error => Err("injected fault (faults.inject = \"error\")".into()),
        FaultKind::Panic => panic!("injected fault (faults.inject = \"panic\")"),
        FaultKind::Hang => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
    }
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

/// One replica's gradients on the main device.
enum Summand<B: AutodiffBackend> {
    Local(GradientsParams),
    Uploaded(DeviceGrads<B::InnerBackend>),
}

/// Sums each parameter's gradient over the replicas, on the main device, in device order.
struct SumGrads<'a, B: AutodiffBackend> {
    parts: &'a mut [Summand<B>],
    out: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let mut acc: Option<Tensor<B::InnerBackend, D>> = None;
        for g in self.parts.iter_mut() {
            let t = match g {
                Summand::Local(g) => g.remove::<B::InnerBackend, D>(param.id),
                Summand::Uploaded(h) => h.take(param.id, param.val().dims()),
            };
            if let Some(t) = t {
                acc = Some(match acc {
                    Some(a) => a + t,
                    None => t,
                });
            }
        }
        if let Some(a) = acc {
            self.out.register::<B::InnerBackend, D>(param.id, a);
        }
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Drop for Replicas<B, M> {
    fn drop(&mut self) {
        // Closing the job channels ends the worker loops.
        for w in self.workers.drain(..) {
            drop(w.jobs);
            let _ = w.handle.join();
        }
    }
}

/// One line per device for the epoch report, and a warning when step times differ by
/// more than 15%, naming the slow device.
pub fn balance_report(load: &[DeviceLoad]) -> (String, Option<String>) {
    let per_step = |l: &DeviceLoad| {
        if l.steps == 0 {
            0.0
        } else {
            l.busy_s * 1e3 / l.steps as f64
        }
    };
    let line = load
        .iter()
        .map(|l| {
            format!(
                "{} {} img/step {:.1} ms",
                l.name,
                l.images.checked_div(l.steps).unwrap_or(0),
                per_step(l)
            )
        })
        .collect::<Vec<_>>()
        .join(" | ");
    let times: Vec<f64> = load.iter().map(per_step).collect();
    let fast = times.iter().cloned().fold(f64::INFINITY, f64::min);
    let (slow_i, slow) =
        times.iter().enumerate().fold(
            (0, 0.0),
            |acc, (i, &t)| if t > acc.1 { (i, t) } else { acc },
        );
    let warning = (fast > 0.0 && slow > 1.15 * fast).then(|| {
        format!(
            "{} takes {:.0}% longer per step than the fastest device ({slow:.1} vs {fast:.1} ms); give it less with train.device_weights",
            load[slow_i].name,
            (slow / fast - 1.0) * 100.0
        )
    });
    (line, warning)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, TrainConfig};
    use crate::model::{ModelSpec, ResNet};
    use crate::test_util::{TestBackend, device, max_diff, rng_lock};
    use burn::module::Module;
    use burn::nn::conv::{Conv2d, Conv2dConfig};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Distribution;
    use burn::tensor::backend::Backend;

    #[test]
    fn shard_sizes_follow_weights_and_never_leave_a_shard_empty() {
        for (n, w, expected) in [
            (256, vec![1.0, 1.0], vec![128, 128]),
            (10, vec![1.0, 1.0, 1.0], vec![4, 3, 3]),
            (3, vec![1.0, 1.0, 1.0], vec![1, 1, 1]),
            (100, vec![3.0, 1.0], vec![75, 25]),
            (4, vec![100.0, 1.0], vec![3, 1]),
            (7, vec![1.0; 8], vec![]),
        ] {
            let got = shard_sizes(n, &w).unwrap_or_default();
            assert_eq!(got, expected, "n={n} w={w:?}");
            if !got.is_empty() {
                assert_eq!(got.iter().sum::<usize>(), n);
                assert!(got.iter().all(|&s| s >= 1));
            }
        }
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

    /// Trains `init` for `steps` steps on `replicas` replicas sharing the CPU device.
    fn train_on<M: Classifier<TestBackend> + AutodiffModule<TestBackend> + 'static>(
        init: &M,
        batches: &[Batch],
        replicas: usize,
        cfg: &Config,
    ) -> M {
        let devices = vec![device(); replicas];
        let names: Vec<String> = (0..replicas).map(|i| format!("cpu#{i}")).collect();
        let mut optim = Optim::<M, TestBackend>::new(&cfg.optim);
        let mut model = init.clone();
        if replicas == 1 {
            for b in batches {
                model = super::super::step::train_step(
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
        let mut r = Replicas::<TestBackend, M>::start(
            &devices,
            &names,
            &[],
            cfg.train.strategy,
            Buckets::mib(cfg.train.transfer_bucket_mib),
        );
        steps(&mut r, model, &mut optim, batches, cfg)
    }

    /// One data-parallel step per batch, at a fixed learning rate.
    fn steps<M: Classifier<TestBackend> + AutodiffModule<TestBackend> + 'static>(
        r: &mut Replicas<TestBackend, M>,
        mut model: M,
        optim: &mut Optim<M, TestBackend>,
        batches: &[Batch],
        cfg: &Config,
    ) -> M {
        for (s, b) in batches.iter().enumerate() {
            model = r
                .step(
                    model,
                    optim,
                    b.clone(),
                    0.05,
                    &cfg.train,
                    s as u64,
                    None,
                    None,
                )
                .unwrap()
                .0;
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
        for strategy in [Strategy::Dp, Strategy::Ddp] {
            cfg.train.strategy = strategy;
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
            (2, Strategy::Dp),
            (3, Strategy::Dp),
            (4, Strategy::Dp),
            (3, Strategy::Ddp),
        ] {
            let mut accum = Config::default();
            accum.train.grad_accum_steps = n;
            let one = params(&train_on(&init, &batches, 1, &accum));
            let mut cfg = Config::default();
            cfg.train.strategy = strategy;
            // Per-tensor transfers on 2 replicas, one bucket for the whole model above.
            cfg.train.transfer_bucket_mib = if n == 2 { 0 } else { 1 };
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
        for strategy in [Strategy::Dp, Strategy::Ddp] {
            let names: Vec<String> = (0..3).map(|i| format!("cpu#{i}")).collect();
            let mut r = Replicas::<TestBackend, ResNet<TestBackend>>::start(
                &[device(), device(), device()],
                &names,
                &[],
                strategy,
                Buckets { bytes: 4096 },
            );
            let cfg = Config::default();
            let mut optim = Optim::new(&cfg.optim);
            let before = super::transfer::buffers(&model, Buckets::default());
            model = steps(&mut r, model, &mut optim, &batches, &cfg);
            model = r.sync_buffers(model, 2).unwrap();
            let once = super::transfer::buffers(&model, Buckets::default());
            assert_ne!(once, before, "training should move the statistics");
            // A second sync averages identical copies: nothing changes.
            model = r.sync_buffers(model, 2).unwrap();
            assert_eq!(
                super::transfer::buffers(&model, Buckets::default()),
                once,
                "{strategy:?}"
            );
        }
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
        failing_replica(Strategy::Dp);
        failing_replica(Strategy::Ddp);
    }

    fn failing_replica(strategy: Strategy) {
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
        let names: Vec<String> = (0..3).map(|i| format!("cpu#{i}")).collect();
        let mut r = Replicas::<TestBackend, Fragile<TestBackend>>::start(
            &[device(), device(), device()],
            &names,
            &[],
            strategy,
            Buckets::default(),
        );
        let mut optim = Optim::new(&Config::default().optim);
        let err = r
            .step(
                model.clone(),
                &mut optim,
                b,
                0.1,
                &TrainConfig::default(),
                7,
                None,
                None,
            )
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
        let ok = r.step(
            model,
            &mut optim,
            batch(6),
            0.1,
            &TrainConfig::default(),
            8,
            None,
            None,
        );
        assert!(ok.is_ok());
    }

    #[test]
    fn balance_report_names_a_slow_device() {
        let load = |name: &str, busy: f64| DeviceLoad {
            name: name.into(),
            images: 1280,
            steps: 10,
            busy_s: busy,
        };
        let (line, warn) = balance_report(&[load("cuda:0", 0.40), load("cuda:1", 0.50)]);
        assert!(line.contains("cuda:0 128 img/step 40.0 ms"), "{line}");
        assert!(warn.unwrap().starts_with("cuda:1 takes 25% longer"));
        assert!(
            balance_report(&[load("a", 0.40), load("b", 0.44)])
                .1
                .is_none()
        );
    }
}
