//! `kiln train`: config → device plan → dataset → run dir → trainer. Without
//! `--no-supervisor` the work happens in a child process that `supervise` watches and
//! restarts.

use std::process::ExitCode;

use anyhow::Context;

use super::setup::{kernel_settings, plan_devices, resolve_train};
use crate::cli::TrainArgs;
use crate::collective::{Group, Join};
use crate::config::{self, Config};
use crate::device::{DeviceEnv, DeviceError, DevicePlan, UsageMonitor, World};
use crate::exit::{INTERRUPTED, UsageError};
use crate::run::failure::{Failure, UsedDevice, write_devices, write_failure};
use crate::run::run_dir::{self, LOG_FILE};
use crate::run::signals::Signals;
use crate::train::backend::with_training_backend;
use crate::train::{Outcome, TrainJob};
use std::time::Duration;

pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        return super::dry_run::run(&args);
    }
    let world = World::read().map_err(DeviceError::from)?;
    // A rank that restarted alone could not rejoin the others: a multi-process run is
    // restarted whole, by `kiln launch` (or by the job script around `srun`).
    if args.supervised || args.no_supervisor || world.is_some() {
        let mut created = None;
        let result = train_here(args, world, &mut created);
        // A usage, config or data error before training leaves no empty run behind.
        if let (Err(e), Some(dir)) = (&result, created)
            && crate::exit::code_number(e) == crate::exit::USAGE
        {
            run_dir::discard_unstarted(&dir);
        }
        result
    } else {
        super::supervise::run(args)
    }
}

/// How long the ranks of a multi-process run wait for each other at the start.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Why CUDA runs cannot promise bitwise repetition (BENCHMARKS.md, "Determinism").
const NOT_DETERMINISTIC_ON_CUDA: &str = "train.deterministic = true is not available on CUDA with Burn 0.21: cubecl chooses matmul, convolution and reduction kernels by timing them (autotune), so two runs can add in different orders, and Burn has no deterministic mode that pins them. Train on the CPU (devices.backend = \"cpu\"), which repeats exactly, or set train.deterministic = false";

/// The run's dataset, every image checked, described in one line.
pub(super) fn open_data(config: &Config) -> anyhow::Result<crate::data::Dataset> {
    let dataset = crate::data::open(&config.data, config.train.seed)?;
    check_images(&dataset, config)?;
    crate::say!(
        "kiln: data: {:?} at {} ({} train / {} test images, {}x{}x{}, {} classes)",
        config.data.dataset,
        if dataset.root.as_os_str().is_empty() {
            "(generated)".into()
        } else {
            dataset.root.display().to_string()
        },
        dataset.train.len(),
        dataset.test.len(),
        dataset.shape().channels,
        dataset.shape().height,
        dataset.shape().width,
        dataset.classes.len()
    );
    Ok(dataset)
}

/// `config` as a run records it: the dataset's absolute location included.
pub(super) fn as_recorded(config: &Config, dataset: &crate::data::Dataset) -> Config {
    let mut recorded = config.clone();
    recorded.data.root = dataset.root.display().to_string();
    recorded
}

/// `train.deterministic` where the devices cannot keep the promise.
pub(super) fn refuse_unrepeatable(config: &Config, plan: &DevicePlan) -> anyhow::Result<()> {
    if config.train.deterministic && matches!(plan, DevicePlan::Cuda { .. }) {
        return Err(UsageError(NOT_DETERMINISTIC_ON_CUDA.into()).into());
    }
    Ok(())
}

/// Trains in this process: alone, or as one rank of `world`.
/// `created`: the run dir this call made, if it made one.
fn train_here(
    args: TrainArgs,
    world: Option<World>,
    created: &mut Option<std::path::PathBuf>,
) -> anyhow::Result<ExitCode> {
    let signals = Signals::for_trainer();
    let resolved = resolve_train(&args)?;
    let (resume_dir, mut config, name, notes) = (
        resolved.resume_dir,
        resolved.config,
        resolved.name,
        resolved.notes,
    );
    let lead = world.as_ref().is_none_or(|w| w.rank == 0);
    for note in notes.iter().filter(|_| lead) {
        crate::say!("kiln: note: {note}");
    }
    if let Some(w) = &world {
        crate::say!("kiln: process: {}", w.describe());
        one_gpu_per_rank(&mut config, w);
    }
    let plan = match plan_devices(&config.devices) {
        Ok(p) => p,
        Err(e) => {
            // A supervisor would only meet the same machine again: tell it not to.
            if let (true, Some(dir)) = (
                args.supervised,
                resume_dir.as_ref().or(args.run_dir.as_ref()),
            ) && e
                .downcast_ref::<DeviceError>()
                .is_some_and(DeviceError::is_unavailable)
            {
                let _ = write_failure(dir, &Failure::unavailable(format!("{e:#}")));
            }
            return Err(e);
        }
    };
    refuse_unrepeatable(&config, &plan)?;
    let mut run_dir = match (&resume_dir, &args.run_dir) {
        (Some(dir), _) => Some(dir.clone()),
        (None, Some(dir)) => Some(dir.clone()),
        // The other ranks learn rank 0's run dir at the rendezvous.
        (None, None) if lead => {
            let dir = run_dir::create(&args.output, &name)?;
            *created = Some(dir.clone());
            Some(dir)
        }
        (None, None) => None,
    };
    let group = match &world {
        Some(w) => {
            let hash = config.training_hash();
            let device = plan.device_names().join(", ");
            let group = Group::join(&Join {
                rank: w.rank,
                size: w.size,
                master: &w.master(),
                port: w.master_port,
                timeout: RENDEZVOUS_TIMEOUT,
                training_hash: &hash,
                run_dir: run_dir.as_deref(),
                device: &device,
            })?;
            run_dir = Some(group.run_dir().to_path_buf());
            if lead {
                crate::say!(
                    "kiln: {} processes joined: {}",
                    w.size,
                    group
                        .members()
                        .iter()
                        .map(|m| format!(
                            "rank {} {} on {} (pid {})",
                            m.rank, m.device, m.host, m.pid
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            Some(group)
        }
        None => None,
    };
    let run_dir = run_dir.expect("every rank has a run dir after the rendezvous");
    // One live process per run dir: a supervisor or launcher holds the lock for the
    // processes it starts.
    let _lock = if world.is_none() && !args.supervised {
        let (lock, note) = run_dir::lock(&run_dir)?;
        if let Some(n) = note {
            crate::say!("kiln: note: {n}");
        }
        Some(lock)
    } else {
        None
    };
    let log = match (&world, lead) {
        (Some(w), false) => format!("train.rank-{}.log", w.rank),
        _ => LOG_FILE.to_string(),
    };
    if let Err(e) = crate::console::log_to(&run_dir.join(&log)) {
        crate::say!(
            "kiln: warning: cannot keep a log in {}: {e}",
            run_dir.join(&log).display()
        );
    }

    let used: Vec<UsedDevice> = match &plan {
        DevicePlan::Cuda { gpus, .. } => gpus
            .iter()
            .map(|g| UsedDevice {
                name: format!("cuda:{} {}", g.ordinal, g.name),
                uuid: g.uuid.clone(),
            })
            .collect(),
        DevicePlan::Cpu { .. } => vec![UsedDevice {
            name: "cpu".into(),
            uuid: String::new(),
        }],
    };
    // The single-process supervisor reads it; `kiln launch` keeps its own rank map.
    if world.is_none() {
        write_devices(&run_dir, &used)
            .with_context(|| format!("writing the device list into {}", run_dir.display()))?;
    }
    let dataset = open_data(&config)?;
    let resolved = as_recorded(&config, &dataset);
    let config_path = run_dir.join("config.toml");
    if lead {
        crate::report::write_atomic(&config_path, config::to_toml(&resolved).as_bytes())
            .with_context(|| format!("writing {}", config_path.display()))?;
        crate::say!("kiln: run dir: {}", run_dir.display());
    }

    let kernels = kernel_settings(&config, &plan)?;
    let job = TrainJob {
        config: resolved,
        dataset,
        run_dir: run_dir.clone(),
        resume: resume_dir.is_some(),
        devices: plan.device_names(),
        interrupt: signals.flag(),
        kernel_cache: matches!(plan, DevicePlan::Cuda { .. }).then(|| kernels.cache_dir.clone()),
        usage: match &plan {
            DevicePlan::Cuda { gpus, .. } => Some(UsageMonitor::new(
                gpus.iter().map(|g| g.pci_bus_id.clone()).collect(),
            )),
            DevicePlan::Cpu { .. } => None,
        },
        group,
    };
    let recompute = job.config.kernels.gradient_checkpointing;
    let (outcome, state) = with_training_backend(&plan, &kernels, recompute, job)?;
    if !lead {
        return Ok(match outcome {
            Outcome::Interrupted => ExitCode::from(INTERRUPTED),
            _ => ExitCode::SUCCESS,
        });
    }
    let best = state
        .best()
        .map(|(acc, epoch)| format!(", best {:.2}% at epoch {epoch}", acc * 100.0))
        .unwrap_or_default();
    let last = state
        .history
        .iter()
        .rev()
        .find(|r| !r.test_acc.is_nan())
        .map(|r| format!(": test accuracy {:.2}%", r.test_acc * 100.0))
        .unwrap_or_default();
    Ok(match outcome {
        Outcome::Finished => {
            crate::say!(
                "kiln: finished {} epochs in {:.1} s{last}{best}",
                state.history.len(),
                state.elapsed_s
            );
            ExitCode::SUCCESS
        }
        Outcome::EarlyStopped => {
            crate::say!(
                "kiln: stopped early after {} epochs in {:.1} s{last}{best}",
                state.history.len(),
                state.elapsed_s
            );
            ExitCode::SUCCESS
        }
        Outcome::Stopped => {
            crate::say!(
                "kiln: stopped at step {} (train.max_steps){last}; continue with --resume {}",
                state.step,
                run_dir.display()
            );
            ExitCode::SUCCESS
        }
        Outcome::Interrupted => {
            crate::say!(
                "kiln: interrupted at step {}; checkpoint saved, continue with --resume {}",
                state.step,
                run_dir.display()
            );
            ExitCode::from(INTERRUPTED)
        }
    })
}

/// A rank trains on one GPU: the one it was given (`kiln launch`, or Slurm's
/// `--gpus-per-task`), or, when it sees all of its node's GPUs, the one of its local
/// rank, so that the ranks of a node never share one.
fn one_gpu_per_rank(config: &mut Config, world: &World) {
    let visible = DeviceEnv::read().visible;
    // At most one: a GPU of its own, or none (the CPU).
    let given = visible
        .as_deref()
        .is_some_and(|v| v.split(',').filter(|e| !e.trim().is_empty()).count() <= 1);
    config.devices.main = 0;
    config.devices.select = if config.devices.backend == config::BackendChoice::Cpu || given {
        config::Selection::All
    } else {
        config::Selection::List(vec![world.local_rank])
    };
}

/// Every image of both splits read once before training (those checked by an earlier
/// run are remembered in the cache directory), so a bad file stops the run now, not at
/// the first evaluation.
fn check_images(dataset: &crate::data::Dataset, config: &Config) -> anyhow::Result<()> {
    use sha2::{Digest, Sha256};
    let id: String = Sha256::digest(dataset.root.display().to_string().as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let cache = crate::device::kernel_cache_dir(&config.devices.cache_dir)
        .join("checked-images")
        .join(format!("{id}.txt"));
    let t = std::time::Instant::now();
    let checked = dataset.check(&cache)?;
    if checked > 0 {
        crate::say!(
            "kiln: data: checked {checked} images in {:.1} s (remembered in {})",
            t.elapsed().as_secs_f64(),
            cache.display()
        );
    }
    Ok(())
}
