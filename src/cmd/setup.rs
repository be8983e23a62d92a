//! Glue the subcommands share: resolving `kiln train`'s arguments into a run, planning
//! the devices (probing the driver) and settling which kernels run (probing cuDNN).

use crate::cli::TrainArgs;
use crate::run::run_dir::{self, Request, Resolved};

/// `kiln train`'s arguments resolved: the config (file, `--set`s, `--devices`), the run
/// to resume, notes on what changed.
pub fn resolve_train(args: &TrainArgs) -> anyhow::Result<Resolved> {
    let mut sets = args.sets.clone();
    if let Some(spec) = &args.devices {
        sets.push(crate::cli::devices_override(spec));
    }
    Ok(run_dir::resolve(&Request {
        config: args.config.as_deref(),
        sets: &sets,
        resume: args.resume.as_ref().map(|r| r.as_deref()),
        output: &args.output,
    })?)
}

/// The config of the run in `run` (made by `kiln train`) with `sets` applied, for a
/// command (`eval`, `predict`) that uses the run's saved model: `[model]` keys are
/// refused, since the checkpoint fixes the model.
pub fn run_config(
    run: &std::path::Path,
    sets: &[String],
    command: &str,
) -> anyhow::Result<crate::config::Config> {
    use crate::exit::UsageError;
    let config_path = run.join("config.toml");
    if !config_path.is_file() {
        return Err(UsageError(format!(
            "--run {}: not a kiln run directory (no config.toml)",
            run.display()
        ))
        .into());
    }
    if let Some(s) = sets.iter().find(|s| s.trim_start().starts_with("model.")) {
        return Err(UsageError(format!(
            "--set {s}: kiln {command} uses the model the run trained, as its checkpoint holds it; [model] keys cannot change it (the data, devices and batch size can be set)"
        ))
        .into());
    }
    Ok(crate::config::load(&config_path, sets)?)
}

/// What a run's network takes, as its checkpoint recorded it; for runs from before it
/// was recorded, from the dataset its config names.
pub fn network_input(
    recorded: &Option<crate::data::InputSpec>,
    config: &crate::config::Config,
) -> anyhow::Result<crate::data::InputSpec> {
    Ok(match recorded {
        Some(i) => i.clone(),
        None => crate::data::open(&config.data, config.train.seed)?.input(),
    })
}

/// Where kernels are cached, how they are tuned, what cuDNN runs (convolutions,
/// BatchNorm) and how batches are uploaded, from the config and the plan (cuDNN is
/// looked for on the first GPU).
pub fn kernel_settings(
    config: &crate::config::Config,
    plan: &crate::device::DevicePlan,
) -> anyhow::Result<crate::train::backend::KernelSettings> {
    use crate::config::{BatchNormKernels, Convolution};
    use crate::train::backend::{probe_cudnn, probe_cudnn_batch_norm};
    let (conv, norm) = (config.kernels.convolution, config.kernels.batch_norm);
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
            crate::say!("kiln: convolutions: cuDNN {version}");
            true
        }
        (Some(Err(why)), Convolution::Cudnn) => anyhow::bail!(
            "kernels.convolution = \"cudnn\" but cuDNN cannot be used: {why}. {install}, or set \
             kernels.convolution = \"auto\" or \"burn\""
        ),
        (Some(Err(why)), Convolution::Auto) => {
            crate::say!("kiln: convolutions: Burn's kernels (cuDNN: {why})");
            false
        }
    };
    let usable = probe.map(|p| p.and_then(|_| probe_cudnn_batch_norm()));
    let cudnn_batch_norm = match (usable, norm) {
        (None, _) | (_, BatchNormKernels::Burn) => false,
        (Some(_), BatchNormKernels::Auto) => {
            crate::say!("kiln: batch norm: kiln's kernels");
            false
        }
        (Some(Ok(())), BatchNormKernels::Cudnn) => {
            crate::say!("kiln: batch norm: cuDNN");
            true
        }
        (Some(Err(why)), BatchNormKernels::Cudnn) => anyhow::bail!(
            "kernels.batch_norm = \"cudnn\" but cuDNN cannot be used: {why}. {install}, or set \
             kernels.batch_norm = \"auto\" or \"burn\""
        ),
    };
    let on_cuda = matches!(plan, crate::device::DevicePlan::Cuda { .. });
    // kiln's own kernels need no cuDNN.
    let kiln_norm = on_cuda && norm == BatchNormKernels::Auto;
    let norm_ok = kiln_norm || cudnn_batch_norm;
    if on_cuda && config.kernels.channels_last && (!cudnn_convolutions || !norm_ok) {
        anyhow::bail!(
            "kernels.channels_last = true needs cuDNN's convolutions, and batch norm on kiln's \
             or cuDNN's kernels, on CUDA: Burn's kernels take NCHW and would run it only \
             through permuted views, many times slower. Set kernels.channels_last = false, \
             or kernels.convolution \"auto\" or \"cudnn\" and kernels.batch_norm \"auto\" \
             or \"cudnn\" ({install})"
        );
    }
    Ok(crate::train::backend::KernelSettings {
        cache_dir: crate::device::kernel_cache_dir(&config.devices.cache_dir),
        autotune: config.kernels.autotune,
        cudnn_convolutions,
        cudnn_batch_norm,
        kiln_norm,
        conv_workspace: config.kernels.conv_workspace_mib as usize * (1 << 20),
        exact_pool: config.kernels.memory_pool == crate::config::MemoryPool::Exact,
        // Applied by the CUDA backend only; the CPU uploads nothing.
        pinned_uploads: config.data.pin_memory,
    })
}

/// Applies `devices.visible`, probes the driver and NVML, and resolves `[devices]`,
/// printing where the work runs and why.
pub fn plan_devices(
    cfg: &crate::config::DevicesConfig,
) -> anyhow::Result<crate::device::DevicePlan> {
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
        crate::say!("kiln: warning: {note}");
    }
    match &plan {
        DevicePlan::Cuda { reason, .. } => {
            crate::say!(
                "kiln: devices: {} ({reason}; {})",
                plan.describe(),
                env.source()
            );
        }
        DevicePlan::Cpu { reason } => crate::say!("kiln: training on the CPU: {reason}"),
    }
    Ok(plan)
}
