//! One entry function per subcommand. This is glue: it resolves paths and plans, then
//! calls into the library modules; `anyhow` context is added here.

mod bench;
mod devices;
mod eval;
mod train;

use std::process::ExitCode;

use crate::cli::{Cli, Command};

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Train(args) => train::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Devices(args) => devices::run(args),
        Command::Bench(args) => bench::run(args),
    }
}

/// Where kernels are cached and how they are tuned, from the config.
fn kernel_settings(config: &crate::config::Config) -> crate::train::backend::KernelSettings {
    crate::train::backend::KernelSettings {
        cache_dir: crate::device::kernel_cache_dir(&config.devices.cache_dir),
        autotune: config.train.autotune,
    }
}

/// Probes the driver and resolves `[devices]`, printing where training runs and why.
fn plan_devices(cfg: &crate::config::DevicesConfig) -> anyhow::Result<crate::device::DevicePlan> {
    use crate::device::{DevicePlan, plan, probe, visible_env};
    let env = visible_env();
    let plan = plan(cfg, &probe(), env.as_deref())?;
    match &plan {
        DevicePlan::Cuda { .. } => eprintln!("kiln: device: {}", plan.describe()),
        DevicePlan::Cpu { reason } => eprintln!("kiln: training on the CPU: {reason}"),
    }
    Ok(plan)
}
