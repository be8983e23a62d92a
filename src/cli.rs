//! The command line (clap derive). Knobs live in the config schema and are reached
//! with `--set`; flags are only for what is not training configuration.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "kiln", version, about = "Train image classifiers on one or several GPUs (Burn + CUDA)", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Only warnings and errors on the terminal (the run's train.log keeps every line).
    #[arg(long, short, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Also details: checkpoint and test-pass times, the gradient exchange's buckets.
    #[arg(long, short, global = true)]
    pub verbose: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model from a TOML config.
    #[command(
        after_help = "Exit codes: 0 finished or stopped at train.max_steps, 1 failed, 2 usage/config/data error,\n75 GPU unavailable, 130 interrupted (a checkpoint was written)."
    )]
    Train(TrainArgs),
    /// Evaluate a run's saved model on a dataset split.
    Eval(EvalArgs),
    /// Classify image files (PNG, JPEG; folders are searched) with a run's saved model.
    Predict(PredictArgs),
    /// Write a run's saved model as safetensors under torchvision's names, for PyTorch.
    Export(ExportArgs),
    /// Show the GPUs kiln can see and how CUDA_VISIBLE_DEVICES maps them.
    Devices(DevicesArgs),
    /// Measure training throughput on synthetic data (same model and step as `train`).
    Bench(BenchArgs),
    /// Fill the kernel and autotune caches for a config ahead of its run (CUDA).
    Warmup(WarmupArgs),
    /// Train with one process per GPU (data parallel across processes), restarting all
    /// of them from the latest checkpoint when one fails.
    #[command(
        after_help = "Exit codes: as for `kiln train`; 75 when a process failed and the restarts ran out.\nEach process sees only its own GPU; ranks other than 0 print their notes prefixed `rank N:`."
    )]
    Launch(LaunchArgs),
    /// Train many variants of a config (grid and random search), one GPU slot per trial.
    #[command(
        after_help = "Exit codes: 0 every trial finished, 1 some trial failed (the others ran), 2 bad sweep file,
130 interrupted (continue with --resume SWEEP_DIR)."
    )]
    Sweep(SweepArgs),
    /// Print a completion script for a shell, e.g. `kiln completions bash >
    /// ~/.local/share/bash-completion/completions/kiln`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, clap::Args)]
pub struct WarmupArgs {
    /// Config file (TOML) of the run to prepare.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Override a config key, as for `train`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Which GPUs, as for `train`.
    #[arg(long, value_name = "GPUS", value_parser = devices_spec)]
    pub devices: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct LaunchArgs {
    /// Processes to start, one per GPU. Default: one per GPU that `[devices]` (or
    /// `--devices`) picks; on the CPU it must be given.
    #[arg(long, value_name = "N", conflicts_with = "srun")]
    pub nproc: Option<usize>,
    /// TCP port on which rank 0 meets the others (default: a free one).
    #[arg(long, value_name = "PORT", conflicts_with = "srun")]
    pub port: Option<u16>,
    /// Inside a Slurm allocation: start the processes as one `srun` step (one task per
    /// GPU, as the allocation's `--ntasks` says) instead of on this machine; the run
    /// dir must be on storage the nodes share.
    #[arg(long)]
    pub srun: bool,
    /// Extra arguments for srun, e.g. `--srun-arg=--gpus-per-task=1` (repeatable).
    #[arg(
        long = "srun-arg",
        value_name = "ARG",
        requires = "srun",
        allow_hyphen_values = true
    )]
    pub srun_args: Vec<String>,
    #[command(flatten)]
    pub train: TrainArgs,
}

#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// Sweep file (TOML): base config, axes, metric, gpus_per_trial, max_parallel.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub config: Option<PathBuf>,
    /// Folder that holds sweep folders.
    #[arg(long, value_name = "DIR", default_value = "sweeps")]
    pub output: PathBuf,
    /// Continue a sweep: finished trials are kept, unfinished ones resume from their
    /// checkpoints, failed ones run again.
    #[arg(long, value_name = "SWEEP_DIR")]
    pub resume: Option<PathBuf>,
    /// Where the trials run: `local` (this machine's GPUs, or its CPU) or `slurm` (one
    /// job array; the kiln binary and the trials' folders must be on storage the nodes
    /// share). Default: `local`, or `slurm` when resuming a sweep submitted to Slurm.
    #[arg(long, value_enum)]
    pub launcher: Option<Launcher>,
    /// Slurm: partition for the array (overrides the sweep file's `[slurm]`).
    #[arg(long)]
    pub partition: Option<String>,
    /// Slurm: time limit per trial, as sbatch takes it (e.g. `4:00:00`).
    #[arg(long)]
    pub time: Option<String>,
    /// Slurm: account to charge.
    #[arg(long)]
    pub account: Option<String>,
    /// Slurm: submit and return instead of waiting for the array; `--resume` later
    /// waits for it and gathers the results.
    #[arg(long)]
    pub no_wait: bool,
    /// Internal: run trial N of the sweep given by --resume here (a Slurm array element).
    #[arg(long, value_name = "N", hide = true, requires = "resume")]
    pub trial: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Launcher {
    Local,
    Slurm,
}

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Config file (TOML). Optional with `--resume RUN_DIR`, which then reuses the run's config.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. `--set train.epochs=5`; repeatable, applied in order.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Folder that holds run directories.
    #[arg(long, value_name = "DIR", default_value = "checkpoints")]
    pub output: PathBuf,
    /// Continue a run from its newest good checkpoint: RUN_DIR, or without a value the
    /// newest run of this config under --output.
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<Option<PathBuf>>,
    /// Which GPUs to use, overriding `devices.use`: `all`, `auto`, or logical indices
    /// like `0,1` (after CUDA_VISIBLE_DEVICES).
    #[arg(long, value_name = "GPUS", value_parser = devices_spec)]
    pub devices: Option<String>,
    /// Restart a failed run from its latest checkpoint at most this many times (a
    /// failed or hung GPU is left out of the next attempt).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub max_restarts: u32,
    /// Train in this process, without the supervisor (no automatic restarts).
    #[arg(long)]
    pub no_supervisor: bool,
    /// Resolve and print the config, the devices and the data (every image read once),
    /// then stop: nothing trained, no run dir made.
    #[arg(long)]
    pub dry_run: bool,
    /// Set by the supervisor for the process it starts.
    #[arg(long, hide = true)]
    pub supervised: bool,
    /// Set by the supervisor: start a fresh run in this existing directory.
    #[arg(long, hide = true, value_name = "RUN_DIR")]
    pub run_dir: Option<PathBuf>,
}

/// `--devices X` checked: `all`, `auto` or GPU indices like `0,1`.
fn devices_spec(spec: &str) -> Result<String, String> {
    let s = spec.trim();
    let list_ok = !s.is_empty()
        && s.split(',')
            .all(|t| !t.trim().is_empty() && t.trim().bytes().all(|b| b.is_ascii_digit()));
    if s == "all" || s == "auto" || list_ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "expected all, auto or GPU indices such as 0,1 (counted after CUDA_VISIBLE_DEVICES), not {spec:?}"
        ))
    }
}

/// `--devices X` as the `--set` it stands for.
pub fn devices_override(spec: &str) -> String {
    match spec.trim() {
        s @ ("all" | "auto") => format!("devices.use={s}"),
        list => format!("devices.use=[{list}]"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Split {
    Train,
    Test,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Which {
    /// The newest complete checkpoint.
    Latest,
    /// The checkpoint with the best test accuracy.
    Best,
}

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// A run directory made by `kiln train`.
    #[arg(long = "run", value_name = "RUN_DIR")]
    pub run: PathBuf,
    #[arg(long, value_enum, default_value = "test")]
    pub split: Split,
    #[arg(long, value_enum, default_value = "latest")]
    pub checkpoint: Which,
    /// Override a key of the run's config, e.g. `--set data.root=/other/copy` or
    /// `--set devices.backend=cpu`; repeatable, applied in order.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct PredictArgs {
    /// A run directory made by `kiln train`.
    #[arg(long = "run", value_name = "RUN_DIR")]
    pub run: PathBuf,
    /// Image files, or folders to search for them.
    #[arg(value_name = "IMAGE", required = true)]
    pub images: Vec<PathBuf>,
    #[arg(long, value_enum, default_value = "best")]
    pub checkpoint: Which,
    /// Classes shown per image, most probable first.
    #[arg(long, default_value_t = 3)]
    pub top_k: usize,
    /// Which GPUs (the first is used), as for `train`; `--set devices.backend=cpu` for the CPU.
    #[arg(long, value_name = "GPUS", value_parser = devices_spec)]
    pub devices: Option<String>,
    /// Override a key of the run's config (devices, data.num_workers); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Print JSON instead of one line per image.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A run directory made by `kiln train`.
    #[arg(long = "run", value_name = "RUN_DIR")]
    pub run: PathBuf,
    #[arg(long, value_enum, default_value = "best")]
    pub checkpoint: Which,
    /// The file to write (`.safetensors`).
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Replace the file if it exists.
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, clap::Args)]
pub struct DevicesArgs {
    /// Also apply this config's `[devices]` section and show the GPUs it would use.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. `--set devices.use=auto`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Start from this config instead of the built-in one (synthetic data, SGD).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override a config key; applied before the options below.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Network (`model.arch`).
    #[arg(long, default_value = "resnet18")]
    pub model: String,
    /// Image side in pixels (`data.image_size`); the stem follows it (small up to 64 px).
    #[arg(long, default_value_t = 32)]
    pub image_size: u32,
    /// Images per step on each device (the global batch is this times the devices).
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Untimed steps after the first two.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Steps timed phase by phase (upload, forward, backward, optimizer).
    #[arg(long, default_value_t = 10)]
    pub breakdown_steps: usize,
    /// Kernel autotuning (`kernels.autotune`): fast, balanced, extensive or full.
    #[arg(long)]
    pub autotune: Option<String>,
    /// Arithmetic (`train.precision`): fp32, bf16 or fp16.
    #[arg(long)]
    pub precision: Option<String>,
    /// Channels-last activations and weights (`kernels.channels_last = true`).
    #[arg(long)]
    pub channels_last: bool,
    /// Which GPUs (`devices.use`): `all`, `auto`, or logical indices like `0,1`.
    #[arg(long, value_name = "GPUS", value_parser = devices_spec)]
    pub devices: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}
