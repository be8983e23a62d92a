//! `kiln warmup`: fills the kernel and autotune caches for a config ahead of its run.

use std::process::ExitCode;

use crate::cli::WarmupArgs;
use crate::config;
use crate::device::DevicePlan;
use crate::report::Ticker;
use crate::train::WarmupJob;
use crate::train::backend::with_training_backend;

pub fn run(args: WarmupArgs) -> anyhow::Result<ExitCode> {
    let mut sets = args.sets.clone();
    if let Some(spec) = &args.devices {
        sets.push(crate::cli::devices_override(spec));
    }
    let config = config::load(&args.config, &sets)?;
    let plan = super::setup::plan_devices(&config.devices)?;
    if let DevicePlan::Cpu { .. } = plan {
        crate::say!("kiln warmup: the CPU backend compiles nothing ahead: nothing to warm up");
        return Ok(ExitCode::SUCCESS);
    }
    let dataset = crate::data::open(&config.data, config.train.seed)?;
    let kernels = super::setup::kernel_settings(&config, &plan)?;
    let ticker = Ticker::start(
        "warmup: compiling kernels and autotuning".into(),
        kernels.cache_dir.clone(),
    );
    let report = with_training_backend(
        &plan,
        &kernels,
        config.kernels.gradient_checkpointing,
        WarmupJob {
            config: config.clone(),
            dataset,
            device_names: plan.device_names(),
        },
    )?;
    drop(ticker);
    crate::out!(
        "kiln warmup: training step {:.1} s, test pass {:.1} s; caches in {}",
        report.train_step_s,
        report.eval_s,
        kernels.cache_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
