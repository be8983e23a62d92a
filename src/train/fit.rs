//! The training loop. It restores or initialises, then runs epochs of steps and calls
//! the components around it; each decides its own "when": the checkpointer when a
//! checkpoint is due, the evaluator when a test pass is, the progress display when to
//! print, the usage sampler when to ask NVML. How a step runs on one device, on
//! several, or across processes is the strategy's (`strategy`), behind the learner.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::backend::BackendJob;
use super::build::build;
use super::checkpoint::Checkpointer;
use super::early_stop::EarlyStop;
use super::error::TrainError;
use super::evaluator::{Evaluator, means_or_nan};
use super::faults::Faults;
use super::learner::Learner;
use super::loss_scale::LossScale;
use super::lr_schedule::{Horizon, lr_at};
use super::state::{EpochSoFar, TrainState};
use super::strategy::{self, ReplicaError, StepInput};
use super::watchdog::Watchdog;
use crate::collective::Group;
use crate::config::Config;
use crate::data::Dataset;
use crate::device::{UsageMonitor, UsageSampler};
use crate::ops::TrainBackend;
use crate::report::{self, Board, DeviceUsage, EpochRecord, Progress, Ticker, epoch_line};
use crate::run::failure::{Failure, write_failure};

/// How `fit` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All epochs done.
    Finished,
    /// `train.max_steps` reached; resumable.
    Stopped,
    /// SIGINT/SIGTERM; a checkpoint was written.
    Interrupted,
    /// `train.early_stop_patience` epochs without a better test accuracy.
    EarlyStopped,
}

impl Outcome {
    /// How `summary.json` names it.
    fn status(self) -> &'static str {
        match self {
            // Done by its own rule: a sweep ranks it with the runs that finished.
            Outcome::Finished | Outcome::EarlyStopped => "finished",
            Outcome::Stopped => "stopped at train.max_steps",
            Outcome::Interrupted => "interrupted",
        }
    }

    /// Why the run ended, as `summary.json` says (early stopping says more).
    fn ended(self) -> &'static str {
        match self {
            Outcome::Finished => "train.epochs reached",
            Outcome::Stopped => "train.max_steps reached",
            Outcome::Interrupted => "a signal (SIGINT or SIGTERM)",
            Outcome::EarlyStopped => "early stop",
        }
    }
}

/// Everything `kiln train` hands to the backend.
pub struct TrainJob {
    pub config: Config,
    pub dataset: Dataset,
    pub run_dir: PathBuf,
    /// Restore from the run dir's newest good checkpoint (it must have one).
    pub resume: bool,
    /// How reports name the devices, in the order of the backend's devices.
    pub devices: Vec<String>,
    /// Set by the signal handler; checked after every step.
    pub interrupt: Arc<AtomicBool>,
    /// `Some(cache dir)` on CUDA: the first step shows it is compiling kernels.
    pub kernel_cache: Option<PathBuf>,
    /// On CUDA: memory and utilisation of each device, reported every epoch.
    pub usage: Option<UsageMonitor>,
    /// The other processes of a multi-process run (`kiln launch`, `srun`).
    pub group: Option<Group>,
}

impl BackendJob for TrainJob {
    type Output = Result<(Outcome, TrainState), TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        fit::<B>(self, devices)
    }
}

/// Trains on `devices` (the first is the main device; several make a data-parallel run).
pub fn fit<B: TrainBackend>(
    job: TrainJob,
    devices: Vec<B::Device>,
) -> Result<(Outcome, TrainState), TrainError> {
    let TrainJob {
        config: cfg,
        dataset,
        run_dir,
        resume,
        devices: names,
        interrupt,
        kernel_cache,
        usage,
        group,
    } = job;
    let device = devices[0].clone();
    let n_devices = devices.len();
    let strategy =
        strategy::choose::<B, _>(devices, names.clone(), group, &cfg.train, &cfg.parallel)?;
    let (lead, position) = (strategy.lead(), strategy.position());
    let record = |e: TrainError| record_failure(&run_dir, e);
    let watchdog = Watchdog::start(
        cfg.watchdog.hang_timeout_s,
        run_dir.clone(),
        strategy.pending(),
        strategy.aborter(),
    );
    let mut faults = Faults::new(&cfg.faults, &run_dir, position);
    let built = build::<B>(&cfg, &dataset, &device);
    let (train, test) = strategy.shard(built.train, built.test);
    let mut state = TrainState::new(built.spec, dataset.classes.clone(), strategy.devices());
    state.config_sha256 = cfg.training_hash();
    let mut checkpointer = Checkpointer::new(&cfg.checkpoint, &run_dir, lead);
    // The other ranks' progress would repeat rank 0's: they print notes only.
    let log_every = if lead {
        cfg.train.log_every_steps
    } else {
        u64::MAX
    };
    let progress = Progress::new(log_every, cfg.train.epochs);
    let warn = |w: String| crate::say!("kiln: warning: {w}");

    let (mut model, mut optim) = (built.model, built.optim);
    if resume {
        (state, model, optim) =
            checkpointer.restore(state, model, optim, &device, &mut |n| crate::say!("{n}"))?;
    }
    state.input = Some(dataset.input());
    let mut board = Board::open(
        lead.then_some(run_dir.as_path()),
        // Points after the checkpoint's step are trained again; its own is kept.
        resume.then_some(state.step + 1),
    );
    // fp16 needs a loss scale: a resumed run keeps its own, a new run (or one resumed
    // from fp32 or bf16) starts one; other precisions drop it.
    state.loss_scale = LossScale::for_precision(cfg.train.precision)
        .map(|fresh| state.loss_scale.unwrap_or(fresh));
    let mut learner = Learner::start(model, optim, strategy).map_err(record)?;
    let evaluator = Evaluator::new(&cfg.eval, test);
    let mut usage = UsageSampler::new(usage);
    let mut first = FirstStep::new(kernel_cache);

    let steps_per_epoch = train.batches_per_epoch() as u64;
    if steps_per_epoch == 0 {
        return Err(TrainError::BatchTooLarge {
            batch: cfg.train.batch_size,
            images: train.num_images(),
        });
    }
    let horizon = Horizon {
        steps_per_epoch,
        total_steps: steps_per_epoch * cfg.train.epochs as u64,
    };
    let max_steps = match cfg.train.max_steps {
        0 => u64::MAX,
        n => n,
    };
    let mut outcome = Outcome::Finished;
    let early_stop = EarlyStop::new(&cfg.train);
    let mut ended = None;

    'epochs: while state.epoch < cfg.train.epochs {
        if state.step >= max_steps {
            outcome = Outcome::Stopped;
            break;
        }
        if let Some(why) = early_stop.reason(&state.history) {
            if lead {
                crate::say!("kiln: {why}");
            }
            outcome = Outcome::EarlyStopped;
            ended = Some(why);
            break;
        }
        let lr = lr_at(&cfg.optim, horizon, state.step);
        let mut span = EpochSpan::begin(&mut state, lr);
        progress.start_epoch(span.epoch, steps_per_epoch, state.batch_in_epoch);
        let mut window = (Instant::now(), 0usize);
        let mut batches = train.epoch(span.epoch as u64, state.batch_in_epoch as usize);
        loop {
            let t_wait = Instant::now();
            let Some(batch) = batches.next() else { break };
            span.data_wait += t_wait.elapsed().as_secs_f64();
            let batch = batch?;
            span.lr = lr_at(&cfg.optim, horizon, state.step);
            let input = StepInput {
                step: state.step + 1,
                lr: span.lr,
                scale: state.loss_scale.map(|l| l.scale),
                fault: faults.take(state.step + 1, n_devices, position),
                stop_asked: interrupt.load(Ordering::Relaxed),
            };
            first.before();
            watchdog.step_started(input.step);
            let out = learner.step(batch, &input, &watchdog).map_err(record)?;
            watchdog.step_finished();
            // A skipped (overflowed) fp16 step still counts as a step, as with PyTorch's
            // GradScaler: the data and the schedule move on.
            if let Some(l) = &mut state.loss_scale {
                l.update(out.stepped);
            }
            checkpointer.poll()?;
            window.1 += out.images;
            state.step += 1;
            state.batch_in_epoch += 1;
            if let Some(secs) = first.after::<B>(&device) {
                state.first_step_s.push(secs);
                crate::say!("kiln: first step took {secs:.1} s");
                let timeout = cfg.watchdog.hang_timeout_s;
                learner.strategy().first_step_done(timeout);
                window = (Instant::now(), 0);
            }
            let stats = if progress.wants_stats(state.step) && window.1 > 0 {
                let (loss, acc) = means_or_nan(learner.strategy().totals(false)?);
                check_finite(loss, state.step)?;
                let ips = window.1 as f64 / window.0.elapsed().as_secs_f64();
                window = (Instant::now(), 0);
                let scale = state.loss_scale.map(|l| l.scale);
                board.progress(state.step, loss, acc, ips, span.lr, scale, &warn);
                Some((loss, acc, ips))
            } else {
                None
            };
            let (batch_no, step) = (state.batch_in_epoch, state.step);
            progress.step(span.epoch, batch_no, steps_per_epoch, step, stats);
            let end_of_epoch = state.batch_in_epoch == steps_per_epoch;
            usage.maybe_sample(state.step, end_of_epoch);
            // Asked to stop (a signal, or a rank that got one): save where it stands.
            let stop = out
                .stop
                .unwrap_or_else(|| interrupt.load(Ordering::Relaxed));
            let ends = if stop {
                Some(Outcome::Interrupted)
            } else if !end_of_epoch && state.step >= max_steps {
                Some(Outcome::Stopped)
            } else {
                None
            };
            if ends.is_some() || (!end_of_epoch && checkpointer.is_due(state.step, false)) {
                state.epoch_so_far = Some(span.so_far(&mut learner)?);
                checkpointer.save_now(&mut state, &mut learner, None)?;
            }
            if let Some(o) = ends {
                outcome = o;
                break 'epochs;
            }
        }

        let last = span.epoch + 1 == cfg.train.epochs || state.step >= max_steps;
        let record = span.end(state.step, last, &mut learner, &evaluator, &device)?;
        if lead {
            crate::say!("{}", epoch_line(&record, cfg.train.epochs));
        }
        let devices = announce_load(&mut learner, &mut usage, &names);
        board.epoch(&record, &devices, &warn);
        let measured = (!record.test_acc.is_nan()).then_some(record.test_acc);
        state.history.push(record);
        state.epoch += 1;
        state.batch_in_epoch = 0;
        checkpointer.maybe_save(&mut state, true, &mut learner, measured)?;
        if lead {
            write_reports(&run_dir, &state, "running", None)?;
        }
    }
    checkpointer.flush(&mut state)?;
    progress.finish();
    state.elapsed_s = checkpointer.elapsed_s();
    if lead {
        let ended = ended.unwrap_or_else(|| outcome.ended().to_string());
        write_reports(&run_dir, &state, outcome.status(), Some(&ended))?;
    }
    Ok((outcome, state))
}

/// The first step of a process compiles every kernel on CUDA: it is shown while it
/// runs, and timed to the device's end.
struct FirstStep {
    pending: bool,
    /// `Some(kernel cache)` on CUDA.
    cache: Option<PathBuf>,
    ticker: Option<Ticker>,
    start: Instant,
}

impl FirstStep {
    fn new(cache: Option<PathBuf>) -> Self {
        FirstStep {
            pending: true,
            cache,
            ticker: None,
            start: Instant::now(),
        }
    }

    fn before(&mut self) {
        if self.pending {
            self.start = Instant::now();
            self.ticker = self.cache.clone().map(|dir| {
                let what =
                    "first CUDA step: compiling kernels and autotuning (cached for later runs)";
                Ticker::start(what.into(), dir)
            });
        }
    }

    /// The first step's seconds, once, after it.
    fn after<B: TrainBackend>(&mut self, device: &B::Device) -> Option<f64> {
        if !self.pending {
            return None;
        }
        // Wait for the device so the time includes compilation.
        let _ = B::sync(device);
        self.pending = false;
        self.ticker = None;
        Some(self.start.elapsed().as_secs_f64())
    }
}

/// One epoch while it runs: what its checkpoints and its end need.
struct EpochSpan {
    epoch: u32,
    start: Instant,
    /// What a checkpoint inside this epoch kept of it, when the run resumed there.
    carried: EpochSoFar,
    data_wait: f64,
    lr: f64,
}

impl EpochSpan {
    fn begin(state: &mut TrainState, lr: f64) -> Self {
        let carried = state.epoch_so_far.take();
        EpochSpan {
            epoch: state.epoch,
            start: Instant::now(),
            carried: carried
                .filter(|_| state.batch_in_epoch > 0)
                .unwrap_or_default(),
            data_wait: 0.0,
            lr,
        }
    }

    /// The epoch's totals so far over every device and process, for a checkpoint
    /// inside it.
    fn so_far<B: TrainBackend>(&self, learner: &mut Learner<B>) -> Result<EpochSoFar, TrainError> {
        let t = learner.strategy().totals(false)?;
        let t = learner
            .strategy()
            .sum_over_processes(t, "a checkpoint's metrics")?;
        Ok(self
            .carried
            .plus(t, self.start.elapsed().as_secs_f64(), self.data_wait))
    }

    /// The epoch's record: training metrics over every device (and over the part of
    /// the epoch before a resume), and a test pass when due.
    fn end<B: TrainBackend>(
        self,
        step: u64,
        last: bool,
        learner: &mut Learner<B>,
        evaluator: &Evaluator,
        device: &B::Device,
    ) -> Result<EpochRecord, TrainError> {
        let totals = learner.strategy().totals(true)?;
        let during = format!("epoch {}'s training metrics", self.epoch + 1);
        let totals = learner.strategy().sum_over_processes(totals, &during)?;
        let seconds = self.start.elapsed().as_secs_f64();
        let whole = self.carried.plus(totals, seconds, self.data_wait);
        let (train_loss, train_acc) = means_or_nan((whole.loss, whole.correct, whole.images));
        if whole.images > 0 {
            check_finite(train_loss, step)?;
        }
        let (test_loss, test_acc) =
            evaluator.maybe_run(self.epoch + 1, step, last, learner, device)?;
        Ok(EpochRecord {
            epoch: self.epoch + 1,
            step,
            lr: self.lr,
            train_loss,
            train_acc,
            test_loss,
            test_acc,
            img_per_s: whole.images as f64 / whole.seconds,
            // With the test pass.
            epoch_time_s: self.carried.seconds + self.start.elapsed().as_secs_f64(),
            data_wait_s: whole.data_wait_s,
        })
    }
}

/// The epoch's balance between devices and their usage, when there are such; the
/// usage per device.
fn announce_load<B: TrainBackend>(
    learner: &mut Learner<B>,
    usage: &mut UsageSampler,
    names: &[String],
) -> Vec<DeviceUsage> {
    let load = learner.strategy().take_load();
    if !load.is_empty() {
        let (line, warning) = report::balance_report(&load);
        crate::say!("kiln: balance: {line}");
        if let Some(w) = warning {
            crate::say!("kiln: warning: {w}");
        }
    }
    let (line, per_device) = usage.take(names);
    if let Some(line) = line {
        crate::say!("kiln: gpus: {line}");
    }
    per_device
}

fn check_finite(loss: f64, step: u64) -> Result<(), TrainError> {
    if loss.is_finite() {
        Ok(())
    } else {
        Err(TrainError::NonFinite { step, value: loss })
    }
}

/// `metrics.csv`, `summary.json` and `curves.png` from the state.
fn write_reports(
    dir: &std::path::Path,
    state: &TrainState,
    status: &str,
    ended: Option<&str>,
) -> Result<(), TrainError> {
    let err = |path: PathBuf| move |e: String| TrainError::Report { path, message: e };
    let metrics = dir.join("metrics.csv");
    report::write_metrics(&metrics, &state.history)
        .map_err(|e| err(metrics.clone())(e.to_string()))?;
    let summary = dir.join("summary.json");
    report::write_summary(&summary, &state.summary(status, ended))
        .map_err(|e| err(summary.clone())(e.to_string()))?;
    // The plot is a picture of metrics.csv: one that cannot be drawn is a warning, and
    // summary.json stays the truth about the run.
    if !state.history.is_empty() {
        let curves = dir.join("curves.png");
        if let Err(e) = report::write_curves(&curves, &state.history) {
            crate::say!("kiln: warning: cannot draw {}: {e}", curves.display());
        }
    }
    Ok(())
}

/// Writes `failure.json` for the supervisor when a device failed, then passes the
/// error on.
fn record_failure(run_dir: &std::path::Path, e: TrainError) -> TrainError {
    if let TrainError::Replica(ReplicaError::Failed {
        device,
        position,
        step,
        message,
    }) = &e
    {
        let failure = Failure {
            step: *step,
            device_position: Some(*position),
            device: device.clone(),
            kind: "error".into(),
            message: message.clone(),
            permanent: false,
        };
        if let Err(io) = write_failure(run_dir, &failure) {
            crate::say!(
                "kiln: warning: cannot record the failure in {}: {io}",
                run_dir.display()
            );
        }
    }
    e
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Group;
    use crate::config::{Arch, BackendChoice, DatasetKind, FaultKind};
    use crate::run::checkpoints::Store;
    use crate::test_util::{TestBackend, device, rng_lock};
    use crate::train::checkpoint;
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    use burn::tensor::backend::Backend;

    fn config() -> Config {
        let mut c = Config::default();
        c.model.arch = Arch::Tiny;
        c.data.dataset = DatasetKind::Synthetic;
        c.data.image_size = 8;
        c.data.synthetic_train_size = 128;
        c.data.synthetic_test_size = 32;
        c.data.synthetic_classes = 4;
        c.data.num_workers = 2;
        c.train.epochs = 2;
        c.train.batch_size = 16;
        c.train.grad_clip_norm = 1.0;
        c.devices.backend = BackendChoice::Cpu;
        c
    }

    fn job(config: Config, run_dir: &std::path::Path, resume: bool) -> TrainJob {
        TrainJob {
            dataset: crate::data::open(&config.data, config.train.seed).unwrap(),
            config,
            run_dir: run_dir.to_path_buf(),
            resume,
            devices: vec!["cpu".into()],
            interrupt: Arc::new(AtomicBool::new(false)),
            kernel_cache: None,
            usage: None,
            group: None,
        }
    }

    struct Collect(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.push(p.val().into_data().to_vec::<f32>().unwrap());
        }
    }

    fn trainable(run_dir: &std::path::Path, state: &TrainState) -> Vec<Vec<f32>> {
        struct OnlyTrainable(Vec<Vec<f32>>);
        impl<B: Backend> ModuleVisitor<B> for OnlyTrainable {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                let t = p.val();
                if t.is_require_grad() {
                    self.0.push(t.into_data().to_vec::<f32>().unwrap());
                }
            }
        }
        let (dir, _) = Store::new(run_dir).latest_valid(|_| {}).unwrap();
        let model = state.spec.init::<TestBackend>(&device());
        let model = checkpoint::read_model(&dir, model, &device()).unwrap();
        let mut c = OnlyTrainable(Vec::new());
        model.visit(&mut c);
        assert!(!c.0.is_empty());
        c.0
    }

    fn final_params(run_dir: &std::path::Path, state: &TrainState) -> Vec<Vec<f32>> {
        let (dir, _) = Store::new(run_dir).latest_valid(|_| {}).unwrap();
        let model = state.spec.init::<TestBackend>(&device());
        let model = checkpoint::read_model(&dir, model, &device()).unwrap();
        let mut c = Collect(Vec::new());
        model.visit(&mut c);
        c.0
    }

    #[test]
    fn a_run_stopped_mid_epoch_and_resumed_equals_the_uninterrupted_run_bitwise() {
        let _rng = rng_lock();
        let whole = crate::test_util::tempdir();
        let (outcome, a) =
            fit::<TestBackend>(job(config(), whole.path(), false), vec![device()]).unwrap();
        assert_eq!(outcome, Outcome::Finished);

        let parts = crate::test_util::tempdir();
        let mut stop = config();
        stop.train.max_steps = 11; // 8 steps per epoch: stops inside epoch 2
        let (outcome, s) =
            fit::<TestBackend>(job(stop, parts.path(), false), vec![device()]).unwrap();
        assert_eq!(
            (outcome, s.step, s.batch_in_epoch),
            (Outcome::Stopped, 11, 3)
        );
        let (outcome, b) =
            fit::<TestBackend>(job(config(), parts.path(), true), vec![device()]).unwrap();
        assert_eq!(outcome, Outcome::Finished);

        assert_eq!(a.step, 16);
        assert_eq!(b.step, 16);
        let (pa, pb) = (
            final_params(whole.path(), &a),
            final_params(parts.path(), &b),
        );
        assert!(!pa.is_empty());
        assert_eq!(pa, pb, "parameters differ after resume");
        assert_eq!(
            a.history.last().unwrap().test_loss,
            b.history.last().unwrap().test_loss
        );
    }

    #[test]
    fn a_data_parallel_run_resumes_on_another_number_of_devices() {
        let _rng = rng_lock();
        // Two replicas (sharing the CPU) stop mid-epoch; one device finishes the run
        // with the same global batch and schedule.
        let dir = crate::test_util::tempdir();
        let mut stop = config();
        stop.train.max_steps = 11;
        let mut two = job(stop, dir.path(), false);
        two.devices = vec!["cpu#0".into(), "cpu#1".into()];
        let (outcome, s) = fit::<TestBackend>(two, vec![device(), device()]).unwrap();
        assert_eq!((outcome, s.step), (Outcome::Stopped, 11));
        assert_eq!(s.history.len(), 1);
        let (outcome, b) =
            fit::<TestBackend>(job(config(), dir.path(), true), vec![device()]).unwrap();
        assert_eq!(
            (outcome, b.step, b.history.len()),
            (Outcome::Finished, 16, 2)
        );
        assert!(b.history[1].train_loss < b.history[0].train_loss * 1.5);
    }

    #[test]
    fn losing_a_replica_and_finishing_on_the_rest_equals_resuming_on_the_rest() {
        let _rng = rng_lock();
        let three = || vec![device(), device(), device()];
        let names = |n: usize| (0..n).map(|i| format!("cpu#{i}")).collect::<Vec<_>>();
        let mut base = config();
        base.checkpoint.every_steps = 4;
        base.checkpoint.keep_last = 10;

        // Replica 2 fails during step 6 (mid-epoch 1); the run goes on with two.
        let failed = crate::test_util::tempdir();
        let mut faulty = base.clone();
        faulty.faults.inject = FaultKind::Error;
        faulty.faults.device = 2;
        faulty.faults.step = 6;
        let mut j = job(faulty.clone(), failed.path(), false);
        j.devices = names(3);
        let err = fit::<TestBackend>(j, three()).unwrap_err().to_string();
        assert!(err.contains("cpu#2") && err.contains("step 6"), "{err}");
        let record = std::fs::read_to_string(failed.path().join("failure.json")).unwrap();
        assert!(record.contains("\"device_position\": 2"), "{record}");
        let mut j = job(faulty, failed.path(), true);
        j.devices = names(2);
        let (_, a) = fit::<TestBackend>(j, vec![device(), device()]).unwrap();

        // The same run stopped at that checkpoint (step 4) and resumed on two.
        let planned = crate::test_util::tempdir();
        let mut stop = base.clone();
        stop.train.max_steps = 4;
        let mut j = job(stop, planned.path(), false);
        j.devices = names(3);
        fit::<TestBackend>(j, three()).unwrap();
        let mut j = job(base, planned.path(), true);
        j.devices = names(2);
        let (_, b) = fit::<TestBackend>(j, vec![device(), device()]).unwrap();

        assert_eq!((a.step, b.step), (16, 16));
        // Trainable parameters: BatchNorm's running statistics are averaged over the
        // replicas by Burn in hash-map order, which varies in the last bits.
        let (pa, pb) = (trainable(failed.path(), &a), trainable(planned.path(), &b));
        assert_eq!(pa, pb);
    }

    /// `fit` on `size` ranks, each a thread with its own loopback link to rank 0.
    #[allow(clippy::type_complexity)]
    fn fit_ranks(
        size: usize,
        cfg: Config,
        run_dir: &std::path::Path,
        resume: bool,
    ) -> Vec<Result<(Outcome, TrainState), TrainError>> {
        use crate::collective::Join;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (cfg, dir) = (cfg.clone(), run_dir.to_path_buf());
                std::thread::spawn(move || {
                    let master = format!("127.0.0.1:{port}");
                    let group = Group::join(&Join {
                        rank,
                        size,
                        master: &master,
                        port,
                        timeout: std::time::Duration::from_secs(60),
                        training_hash: &cfg.training_hash(),
                        run_dir: Some(&dir),
                        device: "cpu",
                    })?;
                    // Separate processes have separate generators; these threads share
                    // one, so the other ranks draw their (overwritten) initial weights
                    // only after rank 0 has drawn the weights every rank trains.
                    if rank > 0 {
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                    let mut j = job(cfg, &dir, resume);
                    j.group = Some(group);
                    fit::<TestBackend>(j, vec![device()])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn two_processes_train_what_two_replicas_in_one_process_train() {
        let _rng = rng_lock();
        let replicas = crate::test_util::tempdir();
        let mut j = job(config(), replicas.path(), false);
        j.devices = vec!["cpu#0".into(), "cpu#1".into()];
        let (_, a) = fit::<TestBackend>(j, vec![device(), device()]).unwrap();

        let ranks = crate::test_util::tempdir();
        let mut out = fit_ranks(2, config(), ranks.path(), false);
        let (outcome, b) = out.remove(0).unwrap();
        let (_, other) = out.remove(0).unwrap();
        assert_eq!((outcome, b.step, other.step), (Outcome::Finished, 16, 16));
        // The same shards, gradients added in the same order: the same parameters.
        assert_eq!(trainable(replicas.path(), &a), trainable(ranks.path(), &b));
        let (ra, rb) = (a.history.last().unwrap(), b.history.last().unwrap());
        assert!(
            (ra.train_loss - rb.train_loss).abs() < 1e-5,
            "{ra:?} {rb:?}"
        );
        assert!((ra.test_loss - rb.test_loss).abs() < 1e-4, "{ra:?} {rb:?}");
        assert_eq!(ra.test_acc, rb.test_acc);
        assert!(b.devices[1].starts_with("rank 1: cpu"), "{:?}", b.devices);
    }

    #[test]
    fn a_rank_that_fails_ends_the_step_on_every_rank_and_the_run_resumes() {
        let _rng = rng_lock();
        let dir = crate::test_util::tempdir();
        let mut cfg = config();
        cfg.checkpoint.every_steps = 4;
        cfg.faults.inject = FaultKind::Error;
        cfg.faults.device = 1; // counts ranks
        cfg.faults.step = 6;
        let out = fit_ranks(2, cfg.clone(), dir.path(), false);
        let root = out[0].as_ref().err().unwrap().to_string();
        assert!(root.contains("rank 1") && root.contains("step 6"), "{root}");
        let failed = out[1].as_ref().err().unwrap().to_string();
        assert!(failed.contains("step 6"), "{failed}");
        let record = std::fs::read_to_string(dir.path().join("failure.json")).unwrap();
        assert!(record.contains("\"device_position\": 1"), "{record}");
        // The restart (as `kiln launch` makes it): every rank resumes from step 4.
        for h in fit_ranks(2, cfg, dir.path(), true) {
            let (outcome, s) = h.unwrap();
            assert_eq!((outcome, s.step), (Outcome::Finished, 16));
        }
    }

    #[test]
    fn gradient_accumulation_matches_the_full_batch() {
        let _rng = rng_lock();
        // Without BatchNorm's batch statistics in play this would be exact; with them,
        // micro-batches normalise over fewer images, so compare the loss trend only.
        let one = crate::test_util::tempdir();
        let (_, a) = fit::<TestBackend>(job(config(), one.path(), false), vec![device()]).unwrap();
        let mut accum = config();
        accum.train.grad_accum_steps = 2;
        let two = crate::test_util::tempdir();
        let (_, b) = fit::<TestBackend>(job(accum, two.path(), false), vec![device()]).unwrap();
        assert_eq!(
            a.step, b.step,
            "accumulation does not change the number of optimizer steps"
        );
        let (la, lb) = (a.history[1].train_loss, b.history[1].train_loss);
        assert!((la - lb).abs() / la < 0.25, "{la} vs {lb}");
    }
}
