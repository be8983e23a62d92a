//! One entry function per subcommand. This is glue: it resolves paths and plans, then
//! calls into the library modules; `anyhow` context is added here.

mod bench;
mod devices;
mod eval;
mod supervise;
mod sweep;
mod train;
mod warmup;

use std::process::ExitCode;

use crate::cli::{Cli, Command};

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Train(args) => train::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Devices(args) => devices::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Sweep(args) => sweep::run(args),
        Command::Warmup(args) => warmup::run(args),
    }
}

/// Where kernels are cached and how they are tuned, from the config.
fn kernel_settings(config: &crate::config::Config) -> crate::train::backend::KernelSettings {
    crate::train::backend::KernelSettings {
        cache_dir: crate::device::kernel_cache_dir(&config.devices.cache_dir),
        autotune: config.train.autotune,
    }
}

/// Applies `devices.visible`, probes the driver and NVML, and resolves `[devices]`,
/// printing where the work runs and why.
fn plan_devices(cfg: &crate::config::DevicesConfig) -> anyhow::Result<crate::device::DevicePlan> {
    use crate::config::BackendChoice;
    use crate::device::{DeviceEnv, DevicePlan, Inventory, Probe, apply_visible, plan};
    let env = apply_visible(cfg, DeviceEnv::read())?;
    let inventory = if cfg.backend == BackendChoice::Cpu {
        // The CPU was asked for: do not touch the driver at all.
        Inventory::assemble(Probe::Gpus(Vec::new()), Err("not probed".into()))
    } else {
        Inventory::read()
    };
    let (plan, notes) = plan(cfg, &env, &inventory)?;
    for note in notes {
        eprintln!("kiln: warning: {note}");
    }
    match &plan {
        DevicePlan::Cuda { reason, .. } => {
            eprintln!(
                "kiln: devices: {} ({reason}; {})",
                plan.describe(),
                env.source()
            );
        }
        DevicePlan::Cpu { reason } => eprintln!("kiln: training on the CPU: {reason}"),
    }
    Ok(plan)
}
