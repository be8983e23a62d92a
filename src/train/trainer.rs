//! The training loop: restore or initialise, then epochs of steps, with evaluation,
//! reports and checkpoints at their points. Each component decides its own "when";
//! the loop only calls them.

use crate::ops::TrainBackend;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;

use super::backend::BackendJob;
use super::checkpoint::{self, CheckpointError, Snapshot, Store, Writer};
use super::loss_scale::LossScale;
use super::optim::Optim;
use super::parallel::{ReplicaError, Replicas, act_out, balance_report};
use super::ranks::Ranks;
use super::schedule::{Horizon, lr_at};
use super::state::{EpochRecord, TrainState};
use super::step::{Sums, apply, eval_batch, local_grads, means, train_step};
use super::transfer::Buckets;
use super::watchdog::{Pending, Watchdog};
use crate::config::Config;
use crate::config::{FaultKind, FaultsConfig};
use crate::data::{DataError, Dataset, Loader};
use crate::device::{GpuUsage, UsageMonitor};
use crate::dist::{DistError, Group};
use crate::model::{Compute, ModelSpec, ResNet};
use crate::report::{self, Progress, Summary, Ticker};
use crate::run::failure::{Failure, write_failure};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(
        "train.batch_size = {batch} is larger than the training set ({images} images); lower it or use more data"
    )]
    BatchTooLarge { batch: usize, images: usize },
    #[error("the loss became {value} at step {step}; lower optim.lr or set train.grad_clip_norm")]
    NonFinite { step: u64, value: f64 },
    #[error("cannot write {}: {message}", path.display())]
    Report { path: PathBuf, message: String },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(
        "train.device_weights has {weights} entries but {devices} devices are used; give one weight per device or []"
    )]
    DeviceWeights { weights: usize, devices: usize },
    #[error(transparent)]
    Dist(#[from] DistError),
    #[error(
        "a multi-process run trains on one device per process, but this process was given {devices}; start one process per GPU"
    )]
    DevicesPerRank { devices: usize },
    #[error(
        "train.batch_size = {batch} cannot be shared by {ranks} processes{why}; make it a multiple of {multiple}"
    )]
    BatchPerRank {
        batch: usize,
        ranks: usize,
        why: &'static str,
        multiple: usize,
    },
}

/// How `fit` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// All epochs done.
    Finished,
    /// `train.max_steps` reached; resumable.
    Stopped,
    /// SIGINT/SIGTERM; a checkpoint was written.
    Interrupted,
}

/// Everything `kiln train` hands to the backend.
pub struct TrainJob {
    pub config: Config,
    pub dataset: Dataset,
    pub run_dir: PathBuf,
    /// Restore from the run dir's newest good checkpoint (it must have one).
    pub resume: bool,
    pub devices: Vec<String>,
    /// Set by the signal handler; checked after every step.
    pub interrupt: Arc<AtomicBool>,
    /// `Some(cache dir)` on CUDA: the first step shows it is compiling kernels.
    pub kernel_cache: Option<PathBuf>,
    /// On CUDA: memory and utilisation of each device, reported every epoch.
    pub usage: Option<UsageMonitor>,
    /// The other processes of a multi-process run (`kiln launch`, `srun`); this
    /// process then trains one shard of every global batch on its one device.
    pub group: Option<Group>,
}

impl BackendJob for TrainJob {
    type Output = Result<(Outcome, TrainState), TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        fit::<B>(self, devices)
    }
}

struct Run<'a> {
    job: &'a TrainJob,
    store: Store,
    writer: Writer,
    progress: Progress,
    started: Instant,
    /// `elapsed_s` of the state when this process started.
    elapsed_before: f64,
    /// `checkpoint_write_s` of the state when this process started.
    write_s_before: f64,
    /// Writes checkpoints and reports: every run but the ranks other than 0 of a
    /// multi-process run, whose replicas hold the same numbers.
    lead: bool,
}

impl Run<'_> {
    /// Copies the checkpoint to host memory and hands it to the writer thread;
    /// `checkpoint_s` counts only the time training waits for that.
    fn save<B: TrainBackend>(
        &mut self,
        state: &mut TrainState,
        model: &ResNet<B>,
        optim: &Optim<ResNet<B>, B>,
        test_acc: Option<f64>,
    ) -> Result<(), TrainError> {
        if !self.lead {
            return Ok(());
        }
        let t = Instant::now();
        state.elapsed_s = self.elapsed_before + self.started.elapsed().as_secs_f64();
        state.checkpoint_write_s = self.write_s_before + self.writer.written_s();
        let snap = Snapshot::take(model, optim, state, test_acc)?;
        self.writer.submit(snap)?;
        // Counted from the next checkpoint on: this one is already taken.
        state.checkpoint_s += t.elapsed().as_secs_f64();
        state.checkpoints_written += 1;
        Ok(())
    }

    /// Waits until every checkpoint handed over is on disk; before a run reports its end.
    fn flush(&mut self, state: &mut TrainState) -> Result<(), TrainError> {
        let t = Instant::now();
        self.writer.wait()?;
        state.checkpoint_s += t.elapsed().as_secs_f64();
        state.checkpoint_write_s = self.write_s_before + self.writer.written_s();
        Ok(())
    }

    fn write_reports(&self, state: &TrainState, status: &str) -> Result<(), TrainError> {
        if !self.lead {
            return Ok(());
        }
        let dir = &self.job.run_dir;
        let err = |path: PathBuf| move |e: String| TrainError::Report { path, message: e };
        let metrics = dir.join("metrics.csv");
        report::write_metrics(&metrics, &state.history)
            .map_err(|e| err(metrics.clone())(e.to_string()))?;
        let summary = dir.join("summary.json");
        report::write_summary(&summary, &Summary::from_state(state, status))
            .map_err(|e| err(summary.clone())(e.to_string()))?;
        if !state.history.is_empty() {
            let curves = dir.join("curves.png");
            report::write_curves(&curves, &state.history).map_err(err(curves.clone()))?;
        }
        Ok(())
    }
}

/// Trains on `devices` (the first is the main device; several make a data-parallel run).
pub fn fit<B: TrainBackend>(
    mut job: TrainJob,
    devices: Vec<B::Device>,
) -> Result<(Outcome, TrainState), TrainError> {
    let group = job.group.take();
    let cfg = &job.config;
    let device = devices[0].clone();
    let mut ranks = group.map(|g| Ranks::new(g, Buckets::mib(cfg.train.transfer_bucket_mib)));
    if let Some(r) = &ranks {
        check_world(r.size(), devices.len(), &cfg.train)?;
    }
    // Where this process's device stands among all the run's devices: its rank in a
    // multi-process run. Faults and failure records count in these positions.
    let position = ranks.as_ref().map_or(0, Ranks::rank);
    let lead = position == 0;
    // How failures name this process's device.
    let this_device = match &ranks {
        Some(r) => format!("rank {} ({})", r.rank(), job.devices[0]),
        None => job.devices[0].clone(),
    };
    let weights = &cfg.train.device_weights;
    if !weights.is_empty() && weights.len() != devices.len() {
        return Err(TrainError::DeviceWeights {
            weights: weights.len(),
            devices: devices.len(),
        });
    }
    let mut replicas = (devices.len() > 1).then(|| {
        Replicas::<B, ResNet<B>>::start(
            &devices,
            &job.devices,
            weights,
            cfg.train.strategy,
            Buckets::mib(cfg.train.transfer_bucket_mib),
        )
    });
    let pending: Pending = match &replicas {
        Some(r) => r.pending_probe(),
        None => {
            let name = this_device.clone();
            Box::new(move || Some((position, name.clone())))
        }
    };
    let watchdog = Watchdog::start(cfg.train.hang_timeout_s, job.run_dir.clone(), pending);
    let mut faults = Faults::new(&cfg.faults, &job.run_dir, position);
    let spec = model_spec(cfg, &job.dataset);
    B::seed(&device, cfg.train.seed);
    let mut model = spec
        .init::<B>(&device)
        .with_compute(Compute::of(&cfg.train));
    let mut optim = Optim::<ResNet<B>, B>::new(&cfg.optim);
    let devices_used = match &ranks {
        Some(r) => r
            .members()
            .iter()
            .map(|m| format!("rank {}: {} on {}", m.rank, m.device, m.host))
            .collect(),
        None => job.devices.clone(),
    };
    let mut state = TrainState::new(spec, job.dataset.classes.clone(), devices_used.clone());
    state.config_sha256 = cfg.training_hash();
    let store = Store::new(&job.run_dir);
    let mut run = Run {
        job: &job,
        writer: Writer::start(
            store.clone(),
            cfg.checkpoint.keep_last,
            cfg.checkpoint.keep_best,
        ),
        store,
        // The other ranks' progress would repeat rank 0's: they print notes only.
        progress: Progress::new(
            if lead {
                cfg.train.log_every_steps
            } else {
                u64::MAX
            },
            cfg.train.epochs,
        ),
        started: Instant::now(),
        elapsed_before: 0.0,
        write_s_before: 0.0,
        lead,
    };
    if job.resume {
        let mut skipped = Vec::new();
        let Some((dir, _)) = run.store.latest_valid(|e| skipped.push(e.to_string())) else {
            let detail = if skipped.is_empty() {
                String::new()
            } else {
                format!(" (skipped: {})", skipped.join("; "))
            };
            return Err(CheckpointError::NoneFound {
                path: run.store.root().to_path_buf(),
                detail,
            }
            .into());
        };
        for s in &skipped {
            run.progress
                .println(&format!("kiln: warning: skipping {s}"));
        }
        let saved = checkpoint::read_state(&dir)?;
        checkpoint::check_compatible(&dir, &saved, &state)?;
        (model, optim) = checkpoint::read_tensors(&dir, model, optim, &device)?;
        if !saved.config_sha256.is_empty() && saved.config_sha256 != state.config_sha256 {
            run.progress.println(
                "kiln: note: the training config differs from the one that wrote this checkpoint (see the notes above)",
            );
        }
        state = TrainState {
            devices: devices_used.clone(),
            config_sha256: state.config_sha256.clone(),
            ..saved
        };
        run.elapsed_before = state.elapsed_s;
        run.write_s_before = state.checkpoint_write_s;
        run.progress.println(&format!(
            "kiln: resuming from {} (epoch {}, batch {}, step {})",
            dir.display(),
            state.epoch + 1,
            state.batch_in_epoch,
            state.step
        ));
    }
    // fp16 needs a loss scale: a resumed run keeps its own, a new run (or one resumed
    // from fp32 or bf16) starts one; other precisions drop it.
    state.loss_scale = LossScale::for_precision(cfg.train.precision)
        .map(|fresh| state.loss_scale.unwrap_or(fresh));

    if let Some(r) = ranks.as_mut() {
        model = r.share_model(model, &device)?;
    }
    let (train, test) = job
        .dataset
        .loaders(&cfg.data, cfg.train.batch_size, cfg.train.seed);
    let (train, test) = match &ranks {
        Some(r) => (
            train.sharded(r.rank(), r.size()),
            test.sharded(r.rank(), r.size()),
        ),
        None => (train, test),
    };
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
    let max_steps = if cfg.train.max_steps > 0 {
        cfg.train.max_steps
    } else {
        u64::MAX
    };
    let mut first_step_pending = true;
    let mut outcome = Outcome::Finished;
    // A multi-process run stops when any rank was interrupted, all ranks at one step.
    let mut stop_all = false;

    'epochs: while state.epoch < cfg.train.epochs {
        if state.step >= max_steps {
            outcome = Outcome::Stopped;
            break;
        }
        let epoch = state.epoch;
        let epoch_start = Instant::now();
        let first_batch = state.batch_in_epoch;
        run.progress
            .start_epoch(epoch, steps_per_epoch, first_batch);
        let mut sums: Option<Sums<B::InnerBackend>> = None;
        let mut usage = UsageWindow::default();
        let mut window = (Instant::now(), 0usize);
        let mut lr = lr_at(&cfg.optim, horizon, state.step);
        let mut batches = train.epoch(epoch as u64, first_batch as usize);
        let mut data_wait = 0.0;
        loop {
            let t_wait = Instant::now();
            let Some(batch) = batches.next() else { break };
            data_wait += t_wait.elapsed().as_secs_f64();
            let batch = batch?;
            lr = lr_at(&cfg.optim, horizon, state.step);
            let ticker = first_step_pending.then(|| {
                job.kernel_cache.as_ref().map(|dir| {
                    Ticker::start(
                        "first CUDA step: compiling kernels and autotuning (cached for later runs)"
                            .into(),
                        dir.clone(),
                    )
                })
            });
            let t0 = Instant::now();
            let fault = faults.take(state.step + 1, devices.len());
            watchdog.step_started(state.step + 1);
            let scale = state.loss_scale.map(|l| l.scale);
            let (m, s, stepped) = match replicas.as_mut() {
                Some(r) => r
                    .step(
                        model,
                        &mut optim,
                        batch,
                        lr,
                        &cfg.train,
                        state.step + 1,
                        fault,
                        scale,
                    )
                    .map_err(|e| record_failure(&job.run_dir, e))?,
                None => {
                    if let Some((_, kind)) = fault {
                        act_out(kind).map_err(|message| {
                            record_failure(
                                &job.run_dir,
                                ReplicaError::Failed {
                                    device: this_device.clone(),
                                    position,
                                    step: state.step + 1,
                                    message,
                                },
                            )
                        })?;
                    }
                    match ranks.as_mut() {
                        None => {
                            train_step(model, &mut optim, batch, lr, &cfg.train, &device, scale)
                        }
                        Some(r) => {
                            let global = cfg.train.batch_size;
                            let (grads, s) =
                                local_grads(&model, batch, global, &cfg.train, &device, scale);
                            // Waiting for the other ranks is not this device hanging: the
                            // collective has a timeout of its own, which names the rank
                            // that went silent.
                            watchdog.step_finished();
                            let asked = job.interrupt.load(Ordering::Relaxed);
                            let (grads, stop) =
                                r.sum_grads(grads, &model, &device, asked, state.step + 1)?;
                            stop_all = stop;
                            watchdog.step_started(state.step + 1);
                            let (m, stepped) =
                                apply(model, &mut optim, grads, lr, &cfg.train, scale);
                            (m, s, stepped)
                        }
                    }
                }
            };
            watchdog.step_finished();
            // A skipped (overflowed) fp16 step still counts as a step, as with PyTorch's
            // GradScaler: the data and the schedule move on.
            if let Some(l) = &mut state.loss_scale {
                l.update(stepped);
            }
            // A checkpoint that failed on disk stops training now, not at the next one.
            run.writer.poll()?;
            model = m;
            // The whole run's images: every rank trains a shard of the same global batch.
            window.1 += if ranks.is_some() {
                cfg.train.batch_size
            } else {
                s.images
            };
            let step_sums = s;
            state.step += 1;
            state.batch_in_epoch += 1;
            if first_step_pending {
                // Wait for the device so the first-step time includes compilation.
                let _ = B::sync(&device);
                let secs = t0.elapsed().as_secs_f64();
                drop(ticker);
                state.first_step_s.push(secs);
                run.progress
                    .println(&format!("kiln: first step took {secs:.1} s"));
                first_step_pending = false;
                if let Some(r) = ranks.as_mut() {
                    r.set_timeout(collective_timeout(cfg.train.hang_timeout_s));
                }
                window = (Instant::now(), 0);
            }
            sums = Some(match sums {
                Some(acc) => acc.add(step_sums),
                None => step_sums,
            });
            let stats = if run.progress.wants_stats(state.step) && window.1 > 0 {
                let (loss, acc) = sums_snapshot(&sums);
                check_finite(loss, state.step)?;
                let ips = window.1 as f64 / window.0.elapsed().as_secs_f64();
                window = (Instant::now(), 0);
                Some((loss, acc, ips))
            } else {
                None
            };
            run.progress.step(
                epoch,
                state.batch_in_epoch,
                steps_per_epoch,
                state.step,
                stats,
            );

            let interrupted = match &ranks {
                Some(_) => stop_all,
                None => job.interrupt.load(Ordering::Relaxed),
            };
            if interrupted {
                model = synced(
                    &mut replicas,
                    &mut ranks,
                    model,
                    state.step,
                    &job.run_dir,
                    &device,
                )?;
                run.save(&mut state, &model, &optim, None)?;
                run.flush(&mut state)?;
                run.write_reports(&state, "interrupted")?;
                run.progress.finish();
                return Ok((Outcome::Interrupted, state));
            }
            let end_of_epoch = state.batch_in_epoch == steps_per_epoch;
            if let Some(m) = &job.usage
                && (end_of_epoch || state.step.is_multiple_of(USAGE_EVERY_STEPS))
            {
                usage.add(&m.sample());
            }
            let every = cfg.checkpoint.every_steps;
            if state.step >= max_steps && !end_of_epoch {
                model = synced(
                    &mut replicas,
                    &mut ranks,
                    model,
                    state.step,
                    &job.run_dir,
                    &device,
                )?;
                run.save(&mut state, &model, &optim, None)?;
                outcome = Outcome::Stopped;
                break 'epochs;
            }
            if every > 0 && state.step.is_multiple_of(every) && !end_of_epoch {
                model = synced(
                    &mut replicas,
                    &mut ranks,
                    model,
                    state.step,
                    &job.run_dir,
                    &device,
                )?;
                run.save(&mut state, &model, &optim, None)?;
            }
        }

        // End of epoch: evaluate when due, record, report, checkpoint.
        let totals = sums.map(Sums::totals).unwrap_or((0.0, 0.0, 0));
        let during = format!("epoch {}'s training metrics", epoch + 1);
        let ((train_loss, train_acc), images) = run_means(&mut ranks, totals, &during)?;
        if images > 0 {
            check_finite(train_loss, state.step)?;
        }
        let train_time = epoch_start.elapsed().as_secs_f64();
        model = synced(
            &mut replicas,
            &mut ranks,
            model,
            state.step,
            &job.run_dir,
            &device,
        )?;
        let last = epoch + 1 == cfg.train.epochs || state.step >= max_steps;
        let every = cfg.train.eval_every_epochs;
        let (test_loss, test_acc) = if last || (every > 0 && (epoch + 1).is_multiple_of(every)) {
            let totals = evaluate_totals::<B::InnerBackend>(&model.valid(), &test, &device)?;
            let during = format!("epoch {}'s test pass", epoch + 1);
            run_means(&mut ranks, totals, &during)?.0
        } else {
            (f64::NAN, f64::NAN)
        };
        let record = EpochRecord {
            epoch: epoch + 1,
            step: state.step,
            lr,
            train_loss,
            train_acc,
            test_loss,
            test_acc,
            img_per_s: images as f64 / train_time,
            epoch_time_s: epoch_start.elapsed().as_secs_f64(),
            data_wait_s: data_wait,
        };
        if lead {
            run.progress.println(&epoch_line(&record, cfg.train.epochs));
        }
        if let Some(r) = replicas.as_mut() {
            let (line, warning) = balance_report(&r.take_load());
            run.progress.println(&format!("kiln: balance: {line}"));
            if let Some(w) = warning {
                run.progress.println(&format!("kiln: warning: {w}"));
            }
        }
        if let Some(line) = usage.line(&job.devices) {
            run.progress.println(&format!("kiln: gpus: {line}"));
        }
        state.history.push(record);
        state.epoch += 1;
        state.batch_in_epoch = 0;
        run.save(
            &mut state,
            &model,
            &optim,
            (!test_acc.is_nan()).then_some(test_acc),
        )?;
        run.write_reports(&state, "running")?;
    }
    run.flush(&mut state)?;
    run.progress.finish();
    state.elapsed_s = run.elapsed_before + run.started.elapsed().as_secs_f64();
    let status = match outcome {
        Outcome::Finished => "finished",
        Outcome::Stopped => "stopped at train.max_steps",
        Outcome::Interrupted => "interrupted",
    };
    run.write_reports(&state, status)?;
    Ok((outcome, state))
}

/// `model` with BatchNorm statistics averaged over the replicas (before evaluating or
/// saving it).
fn synced<B: TrainBackend>(
    replicas: &mut Option<Replicas<B, ResNet<B>>>,
    ranks: &mut Option<Ranks>,
    model: ResNet<B>,
    step: u64,
    run_dir: &std::path::Path,
    device: &B::Device,
) -> Result<ResNet<B>, TrainError> {
    if let Some(r) = ranks.as_mut() {
        return Ok(r.mean_buffers(model, device, step)?);
    }
    match replicas.as_mut() {
        Some(r) => Ok(r
            .sync_buffers(model, step)
            .map_err(|e| record_failure(run_dir, e))?),
        None => Ok(model),
    }
}

/// How long a rank waits for the others in a collective once the first step (kernel
/// compilation, minutes on a cold cache) is behind them: `train.hang_timeout_s`, or
/// 10 minutes, which covers an evaluation pass or a slow checkpoint on rank 0.
fn collective_timeout(hang_timeout_s: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(if hang_timeout_s > 0.0 {
        hang_timeout_s
    } else {
        600.0
    })
}

/// A multi-process run's rules: one device per process, a shard for every rank (and
/// equal micro-batches in every shard).
fn check_world(
    ranks: usize,
    devices: usize,
    cfg: &crate::config::TrainConfig,
) -> Result<(), TrainError> {
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

/// NVML is sampled every this many steps (and at the end of each epoch).
const USAGE_EVERY_STEPS: u64 = 25;

/// Peak memory and mean utilisation of each device over one epoch's samples.
#[derive(Default)]
struct UsageWindow {
    /// Per device: (peak used MiB, total MiB, utilisation sum, utilisation samples).
    devices: Vec<Option<(u64, u64, u64, u64)>>,
}

impl UsageWindow {
    fn add(&mut self, sample: &[Option<GpuUsage>]) {
        self.devices
            .resize(sample.len().max(self.devices.len()), None);
        for (acc, s) in self.devices.iter_mut().zip(sample) {
            let Some(s) = s else { continue };
            let (peak, total, sum, n) = acc.get_or_insert((0, s.total_mib, 0, 0));
            *peak = (*peak).max(s.used_mib);
            *total = s.total_mib;
            if let Some(u) = s.utilization_pct {
                *sum += u as u64;
                *n += 1;
            }
        }
    }

    fn line(&self, names: &[String]) -> Option<String> {
        let gib = |mib: u64| mib as f64 / 1024.0;
        let parts: Vec<String> = self
            .devices
            .iter()
            .zip(names)
            .filter_map(|(d, name)| {
                let (peak, total, sum, n) = (*d)?;
                let util = sum
                    .checked_div(n)
                    .map(|u| format!(", {u}% busy"))
                    .unwrap_or_default();
                Some(format!(
                    "{name} {:.1}/{:.0} GiB in use{util}",
                    gib(peak),
                    gib(total)
                ))
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join(" | "))
    }
}

/// `[faults]` for one run: fires once, and never again after a restart (a marker in
/// the run dir remembers that it fired).
struct Faults {
    plan: Option<(usize, u64, FaultKind)>,
    marker: PathBuf,
}

impl Faults {
    /// `first`: position of this process's first device among the run's (its rank in a
    /// multi-process run, whose `faults.device` counts ranks).
    fn new(cfg: &FaultsConfig, run_dir: &std::path::Path, first: usize) -> Self {
        let marker = run_dir.join("faults-fired");
        let plan = cfg
            .device
            .checked_sub(first)
            .filter(|_| cfg.inject != FaultKind::None && !marker.exists())
            .map(|device| (device, cfg.step, cfg.inject));
        Faults { plan, marker }
    }

    /// The fault for optimizer step `step`, if it is due on an existing device.
    fn take(&mut self, step: u64, devices: usize) -> Option<(usize, FaultKind)> {
        match self.plan {
            Some((device, at, kind)) if at == step && device < devices => {
                self.plan = None;
                let _ = std::fs::write(
                    &self.marker,
                    format!("{kind:?} on device {device} at step {step}\n"),
                );
                Some((device, kind))
            }
            _ => None,
        }
    }
}

/// Writes `failure.json` for the supervisor, then passes the error on.
fn record_failure(run_dir: &std::path::Path, e: ReplicaError) -> ReplicaError {
    if let ReplicaError::Failed {
        device,
        position,
        step,
        message,
    } = &e
    {
        let failure = Failure {
            step: *step,
            device_position: Some(*position),
            device: device.clone(),
            kind: "error".into(),
            message: message.clone(),
        };
        if let Err(io) = write_failure(run_dir, &failure) {
            eprintln!(
                "kiln: warning: cannot record the failure in {}: {io}",
                run_dir.display()
            );
        }
    }
    e
}

/// The network `[model]` describes, fitted to the dataset's channels, classes and size.
pub fn model_spec(cfg: &Config, dataset: &Dataset) -> ModelSpec {
    let shape = dataset.shape();
    ModelSpec::new(
        cfg.model.arch,
        cfg.model.stem,
        shape.channels,
        dataset.classes.len(),
        shape.height.min(shape.width),
    )
}

/// Reads running sums without consuming them (one synchronisation).
fn sums_snapshot<B: Backend>(sums: &Option<Sums<B>>) -> (f64, f64) {
    match sums {
        Some(s) => Sums {
            loss: s.loss.clone(),
            correct: s.correct.clone(),
            images: s.images,
        }
        .read(),
        None => (f64::NAN, f64::NAN),
    }
}

fn check_finite(loss: f64, step: u64) -> Result<(), TrainError> {
    if loss.is_finite() {
        Ok(())
    } else {
        Err(TrainError::NonFinite { step, value: loss })
    }
}

/// Mean loss and accuracy of `model` over every batch of `loader`.
pub fn evaluate<B: crate::ops::ModelBackend>(
    model: &ResNet<B>,
    loader: &Loader,
    device: &B::Device,
) -> Result<(f64, f64), DataError> {
    Ok(means_or_nan(evaluate_totals(model, loader, device)?))
}

/// Mean loss and accuracy (NaN without images) of `totals` summed over the ranks of a
/// multi-process run, and the images they cover.
fn run_means(
    ranks: &mut Option<Ranks>,
    totals: (f64, f64, usize),
    during: &str,
) -> Result<((f64, f64), usize), TrainError> {
    let totals = match ranks.as_mut() {
        Some(r) => r.sum_totals(totals, during)?,
        None => totals,
    };
    Ok((means_or_nan(totals), totals.2))
}

fn means_or_nan(totals: (f64, f64, usize)) -> (f64, f64) {
    if totals.2 > 0 {
        means(totals)
    } else {
        (f64::NAN, f64::NAN)
    }
}

/// `(loss × images, correct, images)` of `model` over every batch of `loader` (a
/// shard's batches may be empty).
pub fn evaluate_totals<B: crate::ops::ModelBackend>(
    model: &ResNet<B>,
    loader: &Loader,
    device: &B::Device,
) -> Result<(f64, f64, usize), DataError> {
    let mut sums: Option<Sums<B>> = None;
    for batch in loader.epoch(0, 0) {
        let batch = batch?;
        if batch.labels.is_empty() {
            continue;
        }
        let s = eval_batch(model, batch, device);
        sums = Sums::accumulate(sums, s);
    }
    Ok(sums.map(Sums::totals).unwrap_or((0.0, 0.0, 0)))
}

fn epoch_line(r: &EpochRecord, epochs: u32) -> String {
    let test = if r.test_acc.is_nan() {
        String::new()
    } else {
        format!(
            " | test loss {:.4} acc {:.2}%",
            r.test_loss,
            r.test_acc * 100.0
        )
    };
    format!(
        "epoch {}/{}: train loss {:.4} acc {:.2}%{test} | {:.0} img/s | {:.1} s (waiting for data {:.0}%) | lr {:.4}",
        r.epoch,
        epochs,
        r.train_loss,
        r.train_acc * 100.0,
        r.img_per_s,
        r.epoch_time_s,
        100.0 * r.data_wait_s / r.epoch_time_s.max(1e-9),
        r.lr
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, BackendChoice, DatasetKind, FaultKind};
    use crate::test_util::{TestBackend, device, rng_lock};
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;

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

    #[test]
    fn gpu_usage_line_shows_peak_memory_and_mean_utilisation() {
        let u = |used, pct| {
            Some(GpuUsage {
                used_mib: used,
                total_mib: 143_360,
                utilization_pct: Some(pct),
            })
        };
        let mut w = UsageWindow::default();
        assert_eq!(w.line(&["cuda:0".into()]), None);
        w.add(&[u(2048, 90), None]);
        w.add(&[u(7680, 100), None]);
        assert_eq!(
            w.line(&["cuda:0".into(), "cuda:1".into()]).unwrap(),
            "cuda:0 7.5/140 GiB in use, 95% busy"
        );
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
        use crate::dist::Join;
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
