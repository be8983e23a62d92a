//! `kiln bench`: throughput on synthetic data, beside `bench/pytorch_reference.py`.

use std::process::ExitCode;

use crate::cli::BenchArgs;
use crate::config::{self, Config};
use crate::device::{DevicePlan, memory_in_use_mib};
use crate::train::BenchJob;
use crate::train::backend::with_training_backend;

/// The built-in bench config: synthetic images, SGD with momentum, one device.
const BASE: &str = r#"
[data]
dataset = "synthetic"
synthetic_channels = 3
num_workers = 1
[optim]
name = "sgd"
lr = 0.01
momentum = 0.9
weight_decay = 5e-4
schedule = "constant"
"#;

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let mut sets = args.sets.clone();
    sets.push(format!("model.arch={}", args.model));
    sets.push(format!("data.image_size={}", args.image_size));
    sets.push(format!("train.batch_size={}", args.batch));
    // One batch is all the bench reads; ImageNet-sized images get ImageNet's classes.
    sets.push(format!("data.synthetic_train_size={}", args.batch));
    sets.push("data.synthetic_test_size=1".into());
    if !args
        .sets
        .iter()
        .any(|s| s.starts_with("data.synthetic_classes"))
    {
        let classes = if args.image_size > 64 { 1000 } else { 10 };
        sets.push(format!("data.synthetic_classes={classes}"));
    }
    if let Some(spec) = &args.devices {
        sets.push(crate::cli::devices_override(spec));
    }
    if let Some(level) = &args.autotune {
        sets.push(format!("kernels.autotune={level}"));
    }
    if let Some(precision) = &args.precision {
        sets.push(format!("train.precision={precision}"));
    }
    if args.channels_last {
        sets.push("kernels.channels_last=true".into());
    }
    let config: Config = match &args.config {
        Some(path) => config::load(path, &sets)?,
        None => config::load_str(BASE, "kiln bench defaults", &sets)?,
    };
    let plan = super::setup::plan_devices(&config.devices)?;
    // --batch is per device, as in the PyTorch DDP reference.
    let devices = plan.device_names().len();
    let mut config = config;
    config.train.batch_size = args.batch * devices;
    config.data.synthetic_train_size = args.batch * devices;
    let dataset = crate::data::open(&config.data, config.train.seed)?;
    let kernels = super::setup::kernel_settings(&config, &plan)?;
    let report = with_training_backend(
        &plan,
        &kernels,
        config.kernels.gradient_checkpointing,
        BenchJob {
            config: config.clone(),
            device_names: plan.device_names(),
            dataset,
            steps: args.steps,
            warmup: args.warmup,
            breakdown_steps: args.breakdown_steps,
            pool: pool_probe(&plan),
        },
    )?;
    let memory = match &plan {
        DevicePlan::Cuda { gpus, .. } => memory_in_use_mib(gpus[0].ordinal),
        DevicePlan::Cpu { .. } => None,
    };
    let device = plan.device_names().join(", ");
    let mut precision = format!("{:?}", config.train.precision).to_lowercase();
    if args.json {
        let mut doc = serde_json::to_value(&report)?;
        doc["device"] = device.into();
        doc["memory_in_use_mib"] = memory.into();
        doc["autotune"] = format!("{:?}", config.kernels.autotune)
            .to_lowercase()
            .into();
        doc["precision"] = precision.into();
        doc["convolution"] = format!("{:?}", config.kernels.convolution)
            .to_lowercase()
            .into();
        doc["batch_norm"] = format!("{:?}", config.kernels.batch_norm)
            .to_lowercase()
            .into();
        doc["pin_memory"] = config.data.pin_memory.into();
        doc["channels_last"] = config.kernels.channels_last.into();
        crate::out!("{}", serde_json::to_string(&doc)?);
    } else {
        if config.kernels.channels_last {
            precision.push_str(", channels-last");
        }
        crate::out!(
            "kiln bench: {} {}px batch {} ({} per device), {precision}, on {device}",
            report.model,
            report.image_size,
            report.batch,
            report.batch / report.devices.max(1)
        );
        crate::out!(
            "  first step        {:>9.2} s   (second {:.2} s)",
            report.first_step_s,
            report.second_step_s
        );
        crate::out!(
            "  step              {:>9.2} ms  over {} steps",
            report.step_ms,
            report.steps
        );
        crate::out!("  throughput        {:>9.0} img/s", report.img_per_s);
        if let Some(b) = &report.breakdown {
            crate::out!(
                "  synced phases     upload {:.2} (host {:.2}) | forward {:.2} | backward {:.2} | optimizer {:.2} = {:.2} ms",
                b.upload_ms,
                b.upload_host_ms,
                b.forward_ms,
                b.backward_ms,
                b.optimizer_ms,
                b.total_ms
            );
        }
        let w = &report.waits;
        if w.round_trips + w.queued > 0.0 {
            crate::out!(
                "  kiln's waits      {:.0} round trips to cubecl's device thread, {:.2} ms per step summed over threads, {:.0} calls queued without one ({:.2} ms of kiln's work there, of which library calls {:.2} ms, stream ordering {:.2} ms; host waits for a stream: {:.0}, {:.2} ms)",
                w.round_trips,
                w.round_trip_ms,
                w.queued,
                w.on_device_thread_ms,
                w.library_call_ms.values().sum::<f64>(),
                w.ordering_ms,
                w.host_syncs,
                w.host_sync_ms
            );
        }
        if !report.device_busy_ms.is_empty() {
            let busy: Vec<String> = report
                .device_busy_ms
                .iter()
                .map(|ms| format!("{ms:.2}"))
                .collect();
            crate::out!(
                "  busy per device   {} ms per step (forward and backward, synchronised steps)",
                busy.join(" | ")
            );
        }
        if let Some(x) = &report.exchange {
            crate::out!(
                "  gradient exchange {}: adds {:.2} ms to a step, {:.1}% of it (steps {:.2} ms with it, {:.2} ms without, in turns); synchronised: {:.2} ms per device after a {:.2} ms forward and backward pass",
                x.engine,
                x.cost_ms,
                x.share_of_step * 100.0,
                x.step_with_ms,
                x.step_without_ms,
                x.synced_exchange_ms,
                x.synced_compute_ms
            );
        }
        if let Some(mib) = report.pool_reserved_mib {
            let peak = report
                .breakdown
                .as_ref()
                .and_then(|b| b.pool_in_use_after_forward_mib)
                .map(|m| format!(", {m} MiB of it in use after the forward pass"))
                .unwrap_or_default();
            crate::out!("  memory pool       {mib} MiB reserved{peak}");
            if let Some(beside) = report.beside_pool_mib.filter(|&m| m > 0) {
                crate::out!(
                    "  beside the pool  {beside} MiB (cuDNN workspace, upload staging): {} MiB in all",
                    mib + beside
                );
            }
        }
        if let Some(mib) = memory {
            crate::out!("  device memory in use at the end: {mib} MiB (all processes)");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The first GPU's memory pool, read from the calling thread (the one that trains).
fn pool_probe(plan: &DevicePlan) -> Option<crate::train::PoolProbe> {
    match plan {
        #[cfg(feature = "cuda")]
        DevicePlan::Cuda { gpus, .. } => {
            let ordinal = gpus[0].ordinal;
            Some(Box::new(move || crate::ops::cuda::pool_usage(ordinal)))
        }
        _ => None,
    }
}
