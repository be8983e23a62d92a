//! `kiln train`: config → device plan → dataset → run dir → trainer.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

use crate::cli::TrainArgs;
use crate::config::{self, Config};
use crate::device::{DeviceEnv, DeviceError, DevicePlan, UsageMonitor, World};
use crate::dist::{Group, Join};
use crate::exit::{INTERRUPTED, UsageError};
use crate::run::failure::{UsedDevice, write_devices};
use crate::train::backend::with_training_backend;
use crate::train::{Outcome, TrainJob};
use std::time::Duration;

/// Keys whose change would make a resumed run a different run (other network, other
/// data order); everything else may change between resumes and is listed.
const FIXED_ON_RESUME: &[&str] = &[
    "model.",
    "data.dataset",
    "data.image_size",
    "data.max_train_samples",
    "data.synthetic_",
    "train.batch_size",
    "train.seed",
];

pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    let world = World::read().map_err(DeviceError::from)?;
    // A rank that restarted alone could not rejoin the others: a multi-process run is
    // restarted whole, by `kiln launch` (or by the job script around `srun`).
    if args.supervised || args.no_supervisor || world.is_some() {
        train_here(args, world)
    } else {
        super::supervise::run(args)
    }
}

/// How long the ranks of a multi-process run wait for each other at the start.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The run to continue (`--resume`), the config, the config's name, and notes on
/// what changed since the run's own config.
pub fn resolve(args: &TrainArgs) -> anyhow::Result<(Option<PathBuf>, Config, String, Vec<String>)> {
    let resume_dir = match &args.resume {
        None => None,
        Some(None) => Some(newest_run(args)?),
        Some(Some(p)) => Some(p.clone()),
    };
    let mut sets = args.sets.clone();
    if let Some(spec) = &args.devices {
        sets.push(crate::cli::devices_override(spec));
    }
    let (config, name) = load_config(args.config.as_deref(), &sets, resume_dir.as_deref())?;
    let notes = match &resume_dir {
        Some(dir) => check_resumable(dir, &config)?,
        None => Vec::new(),
    };
    Ok((resume_dir, config, name, notes))
}

/// Why CUDA runs cannot promise bitwise repetition (BENCHMARKS.md, "Determinism").
const NOT_DETERMINISTIC_ON_CUDA: &str = "train.deterministic = true is not available on CUDA with Burn 0.21: cubecl chooses matmul, convolution and reduction kernels by timing them (autotune), so two runs can add in different orders, and Burn has no deterministic mode that pins them. Train on the CPU (devices.backend = \"cpu\"), which repeats exactly, or set train.deterministic = false";

/// Trains in this process: alone, or as one rank of `world`.
fn train_here(args: TrainArgs, world: Option<World>) -> anyhow::Result<ExitCode> {
    let (resume_dir, mut config, name, notes) = resolve(&args)?;
    let lead = world.as_ref().is_none_or(|w| w.rank == 0);
    for note in notes.iter().filter(|_| lead) {
        eprintln!("kiln: note: {note}");
    }
    if let Some(w) = &world {
        eprintln!("kiln: process: {}", w.describe());
        one_gpu_per_rank(&mut config, w);
    }
    let plan = super::plan_devices(&config.devices)?;
    if config.train.deterministic && matches!(plan, DevicePlan::Cuda { .. }) {
        return Err(UsageError(NOT_DETERMINISTIC_ON_CUDA.into()).into());
    }
    let mut run_dir = match (&resume_dir, &args.run_dir) {
        (Some(dir), _) => Some(dir.clone()),
        (None, Some(dir)) => Some(dir.clone()),
        // The other ranks learn rank 0's run dir at the rendezvous.
        (None, None) if lead => Some(create_run_dir(&args.output, &name)?),
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
                eprintln!(
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
    let dataset = crate::data::open(&config.data, config.train.seed)?;
    eprintln!(
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

    // Record the config as resolved: the dataset's absolute location included.
    let mut resolved = config.clone();
    resolved.data.root = dataset.root.display().to_string();
    let config_path = run_dir.join("config.toml");
    if lead {
        crate::report::write_atomic(&config_path, config::to_toml(&resolved).as_bytes())
            .with_context(|| format!("writing {}", config_path.display()))?;
        eprintln!("kiln: run dir: {}", run_dir.display());
    }

    let interrupt = install_signal_handler();
    let kernels = super::kernel_settings(&config, &plan)?;
    let job = TrainJob {
        config: resolved,
        dataset,
        run_dir: run_dir.clone(),
        resume: resume_dir.is_some(),
        devices: plan.device_names(),
        interrupt,
        kernel_cache: matches!(plan, DevicePlan::Cuda { .. }).then(|| kernels.cache_dir.clone()),
        usage: match &plan {
            DevicePlan::Cuda { gpus, .. } => Some(UsageMonitor::new(
                gpus.iter().map(|g| g.pci_bus_id.clone()).collect(),
            )),
            DevicePlan::Cpu { .. } => None,
        },
        group,
    };
    let recompute = job.config.train.gradient_checkpointing;
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
            eprintln!(
                "kiln: finished {} epochs in {:.1} s{last}{best}",
                state.history.len(),
                state.elapsed_s
            );
            ExitCode::SUCCESS
        }
        Outcome::Stopped => {
            eprintln!(
                "kiln: stopped at step {} (train.max_steps){last}; continue with --resume {}",
                state.step,
                run_dir.display()
            );
            ExitCode::SUCCESS
        }
        Outcome::Interrupted => {
            eprintln!(
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

/// The config file (plus `--set`), or the run's own `config.toml` when resuming without one.
fn load_config(
    file: Option<&Path>,
    sets: &[String],
    resume_dir: Option<&Path>,
) -> anyhow::Result<(Config, String)> {
    let path = match (file, resume_dir) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(dir)) => dir.join("config.toml"),
        (None, None) => {
            return Err(
                UsageError("kiln train needs --config FILE (or --resume RUN_DIR)".into()).into(),
            );
        }
    };
    let config = config::load(&path, sets)?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    Ok((config, name))
}

fn newest_run(args: &TrainArgs) -> anyhow::Result<PathBuf> {
    let Some(config) = &args.config else {
        return Err(UsageError(
            "--resume without a RUN_DIR needs --config to know which run to continue".into(),
        )
        .into());
    };
    let stem = config
        .file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let prefix = format!("{stem}-");
    let mut runs: Vec<PathBuf> = std::fs::read_dir(&args.output)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
                && p.join("checkpoints").join("latest").is_file()
        })
        .collect();
    runs.sort();
    runs.pop().ok_or_else(|| {
        UsageError(format!(
            "--resume: no run of {} with a checkpoint under {}; start one without --resume, or name the run dir",
            config.display(),
            args.output.display()
        ))
        .into()
    })
}

/// The run dir must exist; keys that define the run must not change.
fn check_resumable(dir: &Path, config: &Config) -> anyhow::Result<Vec<String>> {
    let mut notes = Vec::new();
    let saved_path = dir.join("config.toml");
    if !saved_path.is_file() {
        return Err(UsageError(format!(
            "--resume {}: not a kiln run directory (no config.toml)",
            dir.display()
        ))
        .into());
    }
    let mut saved = config::load(&saved_path, &[])?;
    // The recorded root is absolute; compare the rest as the user wrote it.
    saved.data.root = config.data.root.clone();
    let changes = config::diff(&saved, config);
    let fixed: Vec<String> = changes
        .iter()
        .filter(|(k, _, _)| FIXED_ON_RESUME.iter().any(|f| k.starts_with(f)))
        .map(|(k, a, b)| format!("{k}: {a} -> {b}"))
        .collect();
    if !fixed.is_empty() {
        return Err(UsageError(format!(
            "--resume {}: these keys define the run and cannot change when resuming: {}; start a new run instead",
            dir.display(),
            fixed.join(", ")
        ))
        .into());
    }
    for (k, a, b) in changes {
        notes.push(format!("resuming with {k} changed from {a} to {b}"));
    }
    Ok(notes)
}

pub fn create_run_dir(output: &Path, name: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(output)
        .with_context(|| format!("creating output folder {}", output.display()))?;
    let stamp: String = humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        .to_string()
        .chars()
        .filter(|c| c.is_ascii_digit() || *c == 'T')
        .map(|c| if c == 'T' { '-' } else { c })
        .collect();
    for n in 0.. {
        let dir = output.join(if n == 0 {
            format!("{name}-{stamp}")
        } else {
            format!("{name}-{stamp}-{n}")
        });
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating run dir {}", dir.display())),
        }
    }
    unreachable!("some suffix is free")
}

/// First SIGINT/SIGTERM: finish the step, checkpoint, exit 130. A second one exits now.
fn install_signal_handler() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let result = ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            eprintln!("kiln: second interrupt, exiting without a checkpoint");
            std::process::exit(INTERRUPTED as i32);
        }
        eprintln!(
            "kiln: interrupt: finishing this step and saving a checkpoint (interrupt again to quit now)"
        );
    });
    if let Err(e) = result {
        eprintln!(
            "kiln: warning: cannot catch interrupts ({e}); an interrupt will lose progress since the last checkpoint"
        );
    }
    flag
}
