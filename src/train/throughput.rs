//! `kiln bench`: training throughput of the same model and step as `kiln train`, on
//! one synthetic batch kept in host memory (a fresh copy uploaded every step, made on
//! a thread of its own as a loader's batch is), then a step-time breakdown with a
//! device synchronisation after each phase. With several devices the global batch is
//! `batch x devices`, split by the data-parallel learner, and the report gives the
//! gradient exchange's share of the step.

use crate::ops::{KilnWaits, LibraryCall, TrainBackend, kiln_waits};
use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::Instant;

use burn::optim::GradientsParams;
use serde::Serialize;

use super::backend::BackendJob;
use super::build::build;
use super::error::TrainError;
use super::loss::cross_entropy;
use super::loss_scale::LossScale;
use super::optim::Optim;
use super::step::to_device;
use super::strategy::{self, StepInput, TrainingStrategy};
use super::watchdog::Watchdog;
use crate::config::Config;
use crate::data::{Batch, Dataset};
use crate::model::ResNet;

pub struct BenchJob {
    pub config: Config,
    pub device_names: Vec<String>,
    pub dataset: Dataset,
    /// Timed steps, after `warmup` untimed ones.
    pub steps: usize,
    pub warmup: usize,
    /// Steps timed phase by phase.
    pub breakdown_steps: usize,
    /// The device's memory pool, where the backend has one.
    pub pool: Option<PoolProbe>,
}

/// Reads a device's memory pool.
pub type PoolProbe = Box<dyn Fn() -> Option<PoolUsage>>;

/// A device's memory as the backend holds it, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Handed out to tensors.
    pub in_use: u64,
    /// Reserved from the driver by the pool.
    pub reserved: u64,
    /// The most held at once outside the pool (cuDNN's workspace, upload staging).
    pub beside_peak: u64,
}

/// Milliseconds per step, phase by phase, each ended by a device synchronisation.
#[derive(Debug, Clone, Serialize)]
pub struct Breakdown {
    /// From host memory to the device, the batch already in host memory.
    pub upload_ms: f64,
    /// Of `upload_ms`, the uploading thread's own time before it can go on (with
    /// `data.pin_memory`: the copy into page-locked memory); the rest is the transfer.
    pub upload_host_ms: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
    /// Sum of the phases: above `step_ms` by what synchronising between phases costs.
    pub total_ms: f64,
    /// The pool's bytes in use at the end of the forward pass, when every activation the
    /// backward pass needs is alive, in MiB; the most over the steps. A lower bound of
    /// the step's peak: gradients come on top during the backward pass.
    pub pool_in_use_after_forward_mib: Option<u64>,
}

/// [`crate::ops::KilnWaits`] per step (summed over threads).
#[derive(Debug, Clone, Serialize)]
pub struct Waits {
    pub round_trips: f64,
    pub round_trip_ms: f64,
    pub queued: f64,
    pub on_device_thread_ms: f64,
    /// By kind of call ([`LibraryCall::name`]).
    pub library_call_ms: BTreeMap<&'static str, f64>,
    pub ordering_ms: f64,
    pub host_syncs: f64,
    pub host_sync_ms: f64,
}

impl Waits {
    fn per_step(w: KilnWaits, steps: usize) -> Waits {
        let n = steps.max(1) as f64;
        Waits {
            round_trips: w.round_trips as f64 / n,
            round_trip_ms: w.round_trip_s * 1e3 / n,
            queued: w.queued as f64 / n,
            on_device_thread_ms: w.on_device_thread_s * 1e3 / n,
            library_call_ms: LibraryCall::ALL
                .iter()
                .zip(w.library_call_s)
                .map(|(kind, s)| (kind.name(), s * 1e3 / n))
                .collect(),
            ordering_ms: w.ordering_s * 1e3 / n,
            host_syncs: w.host_syncs as f64 / n,
            host_sync_ms: w.host_sync_s * 1e3 / n,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub image_size: usize,
    /// Images per step, over all devices.
    pub batch: usize,
    pub devices: usize,
    /// First step of this process: kernel compilation and autotuning (or cache loading).
    pub first_step_s: f64,
    pub second_step_s: f64,
    pub steps: usize,
    /// Mean over the timed steps, one synchronisation at the end.
    pub step_ms: f64,
    pub img_per_s: f64,
    /// One device only.
    pub breakdown: Option<Breakdown>,
    /// Per timed step, summed over threads: kiln's round trips to cubecl's device thread
    /// (cuDNN calls, page-locked uploads) and the host's waits for a GPU stream within
    /// them; zero on the CPU.
    pub waits: Waits,
    /// Several devices: each device's forward and backward per timed step.
    pub device_busy_ms: Vec<f64>,
    /// With a gradient exchange: what it costs on synchronised steps.
    pub exchange: Option<Exchanged>,
    /// What the main thread's memory pool on the first device reserved from the driver
    /// by the end, in MiB (its peak: the pool returns nothing to the driver); CUDA only.
    pub pool_reserved_mib: Option<u64>,
    /// The most the first device held outside the pool at once, in MiB (cuDNN's
    /// workspace and the uploads' staging buffers); CUDA only.
    pub beside_pool_mib: Option<u64>,
}

/// The gradient exchange's cost: the same steps timed with it and without it, in
/// turns, and its latency on steps synchronised after the backward pass and after the
/// exchange (which overlap less than unsynchronised steps do).
#[derive(Debug, Clone, Serialize)]
pub struct Exchanged {
    pub engine: String,
    /// Mean step over [`EXCHANGE_ROUNDS`] blocks of `steps` steps each, with the
    /// exchange and without it (the replicas training apart), in turns.
    pub step_with_ms: f64,
    pub step_without_ms: f64,
    /// `step_with_ms - step_without_ms`: what the exchange adds to a step.
    pub cost_ms: f64,
    /// `cost_ms` over `step_with_ms`.
    pub share_of_step: f64,
    pub timed_steps: usize,
    /// On synchronised steps, per device: the exchange from its first call until the
    /// device has finished it, and the forward and backward pass before it.
    pub synced_exchange_ms: f64,
    pub synced_compute_ms: f64,
}

/// Blocks of steps with and without the exchange that [`Exchanged`] compares.
const EXCHANGE_ROUNDS: usize = 2;

impl BackendJob for BenchJob {
    type Output = Result<BenchReport, TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        let device = devices[0].clone();
        let cfg = &self.config;
        let shape = self.dataset.shape();
        let n_devices = devices.len();
        let built = build::<B>(cfg, &self.dataset, &device);
        let batch = built
            .train
            .make(0, &built.train.order(0), 0)
            .expect("synthetic images are made in memory and cannot fail");
        let lr = cfg.optim.lr;
        let sync = || {
            for d in &devices {
                B::sync(d).expect("the device should synchronise");
            }
        };
        let mut strategy = strategy::choose::<B, ResNet<B>>(
            devices.clone(),
            self.device_names.clone(),
            None,
            &cfg.train,
            &cfg.parallel,
        )?;
        let mut optim = built.optim;
        let mut model = strategy.start(built.model, &optim)?;
        // fp16: a fixed loss scale; a step that overflows is skipped, as in training.
        let scale = LossScale::for_precision(cfg.train.precision).map(|l| l.scale);
        let copies = feed(&batch);
        let watchdog = Watchdog::idle();
        let t = Instant::now();
        model = bench_step(
            strategy.as_mut(),
            model,
            &mut optim,
            &copies,
            lr,
            scale,
            &watchdog,
        )?;
        sync();
        let first_step_s = t.elapsed().as_secs_f64();
        crate::say!("kiln: first step {first_step_s:.1} s");
        let t = Instant::now();
        model = bench_step(
            strategy.as_mut(),
            model,
            &mut optim,
            &copies,
            lr,
            scale,
            &watchdog,
        )?;
        sync();
        let second_step_s = t.elapsed().as_secs_f64();
        for _ in 0..self.warmup {
            model = bench_step(
                strategy.as_mut(),
                model,
                &mut optim,
                &copies,
                lr,
                scale,
                &watchdog,
            )?;
        }
        sync();
        strategy.take_load();
        strategy.take_times();
        let mut timed_steps =
            |model: ResNet<B>, strategy: &mut dyn TrainingStrategy<B, ResNet<B>>| {
                let t = Instant::now();
                let mut model = model;
                for _ in 0..self.steps {
                    model = bench_step(strategy, model, &mut optim, &copies, lr, scale, &watchdog)?;
                }
                sync();
                let step_s = t.elapsed().as_secs_f64() / self.steps.max(1) as f64;
                Ok::<_, TrainError>((model, step_s))
            };
        let waited = kiln_waits();
        let (mut model, step_s) = timed_steps(model, strategy.as_mut())?;
        let waits = Waits::per_step(kiln_waits().since(waited), self.steps);
        let device_busy_ms = strategy
            .take_load()
            .iter()
            .map(|l| l.busy_s * 1e3 / l.steps.max(1) as f64)
            .collect();
        let times = strategy.take_times();
        let exchange = match strategy.exchange_engine() {
            None => None,
            Some(engine) => {
                let (mut with_s, mut without_s) = (0.0, 0.0);
                for _ in 0..EXCHANGE_ROUNDS {
                    strategy.exchange_gradients(false);
                    let (m, s) = timed_steps(model, strategy.as_mut())?;
                    without_s += s;
                    strategy.exchange_gradients(true);
                    let (m, s) = timed_steps(m, strategy.as_mut())?;
                    with_s += s;
                    model = m;
                }
                strategy.take_times();
                let rounds = EXCHANGE_ROUNDS as f64;
                let (with_ms, without_ms) = (with_s * 1e3 / rounds, without_s * 1e3 / rounds);
                let per = (times.steps * n_devices).max(1) as f64;
                Some(Exchanged {
                    engine,
                    step_with_ms: with_ms,
                    step_without_ms: without_ms,
                    cost_ms: with_ms - without_ms,
                    share_of_step: (with_ms - without_ms) / with_ms,
                    timed_steps: times.steps,
                    synced_exchange_ms: times.exchange_s * 1e3 / per,
                    synced_compute_ms: times.compute_s * 1e3 / per,
                })
            }
        };
        // Phases are timed on one device; with several, the step above is the figure.
        let breakdown = (n_devices == 1 && exchange.is_none())
            .then(|| self.breakdown(model, &mut optim, &batch, lr, &device));
        let pool = self.pool.as_ref().and_then(|probe| probe());
        let pool_reserved_mib = pool.map(|p| p.reserved >> 20);
        let beside_pool_mib = pool.map(|p| p.beside_peak >> 20);
        Ok(BenchReport {
            model: format!("{:?}", cfg.model.arch).to_lowercase(),
            image_size: shape.height,
            batch: batch.labels.len(),
            devices: n_devices,
            first_step_s,
            second_step_s,
            steps: self.steps,
            step_ms: step_s * 1e3,
            img_per_s: batch.labels.len() as f64 / step_s,
            breakdown,
            waits,
            device_busy_ms,
            exchange,
            pool_reserved_mib,
            beside_pool_mib,
        })
    }
}

/// One training step on the next copy of the batch.
fn bench_step<B: TrainBackend>(
    strategy: &mut dyn TrainingStrategy<B, ResNet<B>>,
    model: ResNet<B>,
    optim: &mut Optim<ResNet<B>, B>,
    copies: &Receiver<Batch>,
    lr: f64,
    scale: Option<f64>,
    watchdog: &Watchdog,
) -> Result<ResNet<B>, TrainError> {
    let batch = copies
        .recv()
        .expect("the feeding thread runs until dropped");
    let input = StepInput {
        step: 0,
        lr,
        scale,
        fault: None,
        stop_asked: false,
    };
    Ok(strategy.step(model, optim, batch, &input, watchdog)?.model)
}

/// Copies of `batch`, made ahead on a thread of their own, as `train`'s loader threads
/// make its batches. Cloning on the step's thread instead charged the bench a cost
/// `train` does not have: a fresh 77 MB ResNet-50 batch is tens of milliseconds of
/// copying and page faults. The thread ends once the receiver is dropped.
fn feed(batch: &Batch) -> Receiver<Batch> {
    let (tx, rx) = sync_channel(2);
    let batch = batch.clone();
    std::thread::Builder::new()
        .name("kiln-bench-feed".into())
        .spawn(move || while tx.send(batch.clone()).is_ok() {})
        .expect("spawning the bench's feeding thread should succeed");
    rx
}

impl BenchJob {
    /// `breakdown_steps` steps with a device synchronisation after each phase.
    fn breakdown<B: TrainBackend>(
        &self,
        mut model: ResNet<B>,
        optim: &mut Optim<ResNet<B>, B>,
        batch: &Batch,
        lr: f64,
        device: &B::Device,
    ) -> Breakdown {
        let (cfg, steps, pool) = (&self.config, self.breakdown_steps, self.pool.as_deref());
        let sync = || B::sync(device).expect("the device should synchronise");
        let mut ms = [0f64; 4];
        let mut host = 0.0;
        let mut peak: Option<u64> = None;
        for _ in 0..steps {
            let batch = batch.clone();
            let t = Instant::now();
            let (images, labels) = to_device::<B>(batch, device);
            host += t.elapsed().as_secs_f64();
            sync();
            ms[0] += t.elapsed().as_secs_f64();

            let t = Instant::now();
            let logits = model.forward(images);
            let loss = cross_entropy(logits, labels, cfg.train.label_smoothing);
            sync();
            ms[1] += t.elapsed().as_secs_f64();
            if let Some(usage) = pool.and_then(|probe| probe()) {
                peak = Some(peak.unwrap_or(0).max(usage.in_use >> 20));
            }

            let t = Instant::now();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            sync();
            ms[2] += t.elapsed().as_secs_f64();

            let t = Instant::now();
            model = optim.step(lr, model, grads);
            sync();
            ms[3] += t.elapsed().as_secs_f64();
        }
        let per = |v: f64| v * 1e3 / steps.max(1) as f64;
        Breakdown {
            upload_ms: per(ms[0]),
            upload_host_ms: per(host),
            forward_ms: per(ms[1]),
            backward_ms: per(ms[2]),
            optimizer_ms: per(ms[3]),
            total_ms: per(ms.iter().sum()),
            pool_in_use_after_forward_mib: peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, DatasetKind};
    use crate::test_util::{TestBackend, device, rng_lock};

    fn job(devices: usize) -> BenchJob {
        let mut config = Config::default();
        config.model.arch = Arch::Tiny;
        config.data.dataset = DatasetKind::Synthetic;
        config.data.image_size = 8;
        config.data.synthetic_classes = 3;
        config.data.synthetic_train_size = 4 * devices;
        config.data.synthetic_test_size = 1;
        config.train.batch_size = 4 * devices;
        BenchJob {
            dataset: crate::data::open(&config.data, 0).unwrap(),
            config,
            device_names: (0..devices).map(|i| format!("cpu#{i}")).collect(),
            steps: 3,
            warmup: 1,
            breakdown_steps: 2,
            pool: None,
        }
    }

    #[test]
    fn one_device_gets_a_breakdown_and_several_their_busy_times() {
        let _rng = rng_lock();
        let one = job(1).run::<TestBackend>(vec![device()]).unwrap();
        assert_eq!((one.batch, one.devices, one.steps), (4, 1, 3));
        let b = one.breakdown.expect("one device is broken down");
        assert!(b.forward_ms > 0.0 && b.backward_ms > 0.0 && b.total_ms >= b.forward_ms);
        assert!(one.device_busy_ms.is_empty());
        assert!(one.img_per_s > 0.0 && one.step_ms > 0.0);
        let two = job(2).run::<TestBackend>(vec![device(); 2]).unwrap();
        assert_eq!((two.batch, two.devices), (8, 2));
        assert!(two.breakdown.is_none());
        assert_eq!(two.device_busy_ms.len(), 2);
        assert!(
            two.device_busy_ms.iter().all(|ms| *ms > 0.0),
            "{:?}",
            two.device_busy_ms
        );
        assert!(one.exchange.is_none());
        let x = two.exchange.expect("two devices exchange gradients");
        assert_eq!((x.engine.as_str(), x.timed_steps), ("host memory", 3));
        assert!(
            x.synced_exchange_ms > 0.0 && x.synced_compute_ms > 0.0,
            "{x:?}"
        );
        assert!(x.step_with_ms > 0.0 && x.step_without_ms > 0.0, "{x:?}");
        assert_eq!(x.cost_ms, x.step_with_ms - x.step_without_ms);
    }
}
