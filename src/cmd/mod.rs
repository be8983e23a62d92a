//! One entry function per subcommand. This is glue: it resolves paths and plans, then
//! calls into the library modules; `anyhow` context is added here.

mod bench;
mod devices;
mod eval;
mod launch;
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
        Command::Launch(args) => launch::run(args),
        Command::Warmup(args) => warmup::run(args),
    }
}

/// Where kernels are cached, how they are tuned, what cuDNN runs (convolutions,
/// BatchNorm) and how batches are uploaded, from the config and the plan (cuDNN is
/// looked for on the first GPU).
fn kernel_settings(
    config: &crate::config::Config,
    plan: &crate::device::DevicePlan,
) -> anyhow::Result<crate::train::backend::KernelSettings> {
    use crate::config::{BatchNormKernels, Convolution};
    use crate::train::backend::{probe_cudnn, probe_cudnn_batch_norm};
    let (conv, norm) = (config.train.convolution, config.train.batch_norm);
    let probe = match plan {
        crate::device::DevicePlan::Cuda { gpus, .. }
            if conv != Convolution::Burn || norm != BatchNormKernels::Burn =>
        {
            Some(probe_cudnn(gpus[0].ordinal))
        }
        _ => None,
    };
    let install = "Install cuDNN 9 (e.g. `pip install nvidia-cudnn-cu12`) and add its lib \
                   directory to LD_LIBRARY_PATH";
    let cudnn_convolutions = match (&probe, conv) {
        (None, _) | (_, Convolution::Burn) => false,
        (Some(Ok(version)), _) => {
            eprintln!("kiln: convolutions: cuDNN {version}");
            true
        }
        (Some(Err(why)), Convolution::Cudnn) => anyhow::bail!(
            "train.convolution = \"cudnn\" but cuDNN cannot be used: {why}. {install}, or set \
             train.convolution = \"auto\" or \"burn\""
        ),
        (Some(Err(why)), Convolution::Auto) => {
            eprintln!("kiln: convolutions: Burn's kernels (cuDNN: {why})");
            false
        }
    };
    let usable = probe.map(|p| p.and_then(|_| probe_cudnn_batch_norm()));
    let own_kernels = config.train.channels_last && norm == BatchNormKernels::Auto;
    let cudnn_batch_norm = match (usable, norm) {
        (None, _) | (_, BatchNormKernels::Burn) => false,
        (Some(_), _) if own_kernels => {
            eprintln!("kiln: batch norm: kiln's channels-last kernels");
            false
        }
        (Some(Ok(())), _) => {
            eprintln!("kiln: batch norm: cuDNN");
            true
        }
        (Some(Err(why)), BatchNormKernels::Cudnn) => anyhow::bail!(
            "train.batch_norm = \"cudnn\" but cuDNN cannot be used: {why}. {install}, or set \
             train.batch_norm = \"auto\" or \"burn\""
        ),
        (Some(Err(why)), BatchNormKernels::Auto) => {
            eprintln!("kiln: batch norm: Burn's operations (cuDNN: {why})");
            false
        }
    };
    let on_cuda = matches!(plan, crate::device::DevicePlan::Cuda { .. });
    // kiln's own kernels need no cuDNN.
    let channels_last_norm = on_cuda && own_kernels;
    let norm_ok = channels_last_norm || cudnn_batch_norm;
    if on_cuda && config.train.channels_last && (!cudnn_convolutions || !norm_ok) {
        anyhow::bail!(
            "train.channels_last = true needs cuDNN's convolutions, and batch norm on kiln's \
             or cuDNN's kernels, on CUDA: Burn's kernels take NCHW and would run it only \
             through permuted views, many times slower (BENCHMARKS.md, tenth session). Set \
             train.channels_last = false, or train.convolution \"auto\" or \"cudnn\" and \
             train.batch_norm \"auto\" or \"cudnn\" ({install})"
        );
    }
    Ok(crate::train::backend::KernelSettings {
        cache_dir: crate::device::kernel_cache_dir(&config.devices.cache_dir),
        autotune: config.train.autotune,
        cudnn_convolutions,
        cudnn_batch_norm,
        channels_last_norm,
        // Applied by the CUDA backend only; the CPU uploads nothing.
        pinned_uploads: config.data.pin_memory,
    })
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
