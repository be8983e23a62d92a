//! `kiln devices`: what the CUDA driver shows this process, without starting training.

use std::process::ExitCode;

use crate::cli::DevicesArgs;
use crate::device::{Probe, kernel_cache_dir, probe, visible_env};

pub fn run(args: DevicesArgs) -> anyhow::Result<ExitCode> {
    let probe = probe();
    let env = visible_env();
    let cache = kernel_cache_dir("");
    if args.json {
        let (status, gpus) = match &probe {
            Probe::NotBuilt => ("built without cuda".to_string(), vec![]),
            Probe::NoDriver(why) => (why.clone(), vec![]),
            Probe::Gpus(g) => ("ok".to_string(), g.clone()),
        };
        let doc = serde_json::json!({
            "cuda_visible_devices": env,
            "driver": status,
            "gpus": gpus,
            "kernel_cache": cache,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    match &env {
        Some(v) => println!("CUDA_VISIBLE_DEVICES={v:?} (logical indices below follow it)"),
        None => println!("CUDA_VISIBLE_DEVICES is not set: every GPU is visible"),
    }
    match probe {
        Probe::NotBuilt => {
            println!("this kiln was built without the `cuda` feature; training runs on the CPU")
        }
        Probe::NoDriver(why) => println!("no usable CUDA driver: {why}; training runs on the CPU"),
        Probe::Gpus(gpus) if gpus.is_empty() => {
            println!("the driver sees no GPU; training runs on the CPU")
        }
        Probe::Gpus(gpus) => {
            println!(
                "{:<6} {:<24} {:<16} {:>10}  {:<5} uuid",
                "cuda", "name", "pci bus", "memory", "cc"
            );
            for g in gpus {
                println!(
                    "{:<6} {:<24} {:<16} {:>6} MiB  {}.{}   {}",
                    g.ordinal,
                    g.name,
                    g.pci_bus_id,
                    g.total_mib,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.uuid
                );
            }
        }
    }
    println!("kernel cache: {}", cache.display());
    Ok(ExitCode::SUCCESS)
}
