//! `kiln devices`: what the CUDA driver and NVML show this process, how
//! `CUDA_VISIBLE_DEVICES` maps logical to physical GPUs, and (with `--config`) which
//! GPUs that config would use. Never starts training.

use std::process::ExitCode;

use crate::cli::DevicesArgs;
use crate::config::{self, Config};
use crate::device::{DeviceEnv, Inventory, Probe, apply_visible, kernel_cache_dir, plan};

pub fn run(args: DevicesArgs) -> anyhow::Result<ExitCode> {
    let config = match &args.config {
        Some(path) => Some(config::load(path, &args.sets)?),
        None if !args.sets.is_empty() => Some(config::load_str("", "--set", &args.sets)?),
        None => None,
    };
    let devices = config
        .as_ref()
        .map(|c: &Config| c.devices.clone())
        .unwrap_or_default();
    let env = apply_visible(&devices, DeviceEnv::read())?;
    let inv = Inventory::read();
    let warnings = inv.visible_warnings(&env);
    let planned = config.as_ref().map(|_| plan(&devices, &env, &inv));
    let cache = kernel_cache_dir(&devices.cache_dir);

    if args.json {
        let (driver, gpus) = match &inv.probe {
            Probe::NotBuilt => ("built without cuda".to_string(), vec![]),
            Probe::NoDriver(why) => (why.clone(), vec![]),
            Probe::Gpus(g) => ("ok".to_string(), g.clone()),
        };
        let (nvml_status, physical, links) = match &inv.nvml {
            Ok(s) => ("ok".to_string(), s.gpus.clone(), s.links.clone()),
            Err(e) => (e.clone(), vec![], vec![]),
        };
        let mut doc = serde_json::json!({
            "cuda_visible_devices": env.visible,
            "source": env.source(),
            "misspelt_variables": env.typos,
            "driver": driver,
            "gpus": gpus,
            "nvml": nvml_status,
            "physical_gpus": physical,
            "links": links,
            "warnings": warnings,
            "kernel_cache": cache,
        });
        if let Some(p) = &planned {
            doc["plan"] = match p {
                Ok((plan, notes)) => {
                    serde_json::json!({ "devices": plan.device_names(), "notes": notes })
                }
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            };
        }
        crate::out!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }

    crate::out!("{}", env.source());
    for (name, value) in &env.typos {
        crate::out!("warning: {name}={value:?} is set, but CUDA reads CUDA_VISIBLE_DEVICES");
    }
    for w in &warnings {
        crate::out!("warning: {w}");
    }
    match &inv.probe {
        Probe::NotBuilt => {
            crate::out!("this kiln was built without the `cuda` feature; training runs on the CPU")
        }
        Probe::NoDriver(why) => {
            crate::out!("no usable CUDA driver: {why}; training runs on the CPU")
        }
        Probe::Gpus(gpus) if gpus.is_empty() => match &env.visible {
            Some(v) => crate::out!(
                "no GPU is visible under CUDA_VISIBLE_DEVICES={v:?}; training runs on the CPU"
            ),
            None => {
                crate::out!("the driver shows no GPU to this process; training runs on the CPU")
            }
        },
        Probe::Gpus(gpus) => {
            crate::out!(
                "{:<5} {:<8} {:<22} {:<17} {:>19} {:>5}  {:<4} uuid / processes",
                "cuda",
                "physical",
                "name",
                "pci bus",
                "free / total MiB",
                "util",
                "cc"
            );
            for g in gpus {
                let (phys, mem, util, procs) = match &g.physical {
                    Some(p) => (
                        p.index.to_string(),
                        format!("{} / {}", p.free_mib, p.total_mib),
                        p.utilization_pct
                            .map(|u| format!("{u}%"))
                            .unwrap_or_else(|| "?".into()),
                        p.processes
                            .iter()
                            .map(|(pid, name, mib)| format!("{name}:{pid} {mib} MiB"))
                            .collect::<Vec<_>>()
                            .join(", "),
                    ),
                    None => (
                        "?".into(),
                        format!("? / {}", g.total_mib),
                        "?".into(),
                        String::new(),
                    ),
                };
                crate::out!(
                    "{:<5} {:<8} {:<22} {:<17} {:>19} {:>5}  {}.{}  {} {}",
                    g.ordinal,
                    phys,
                    g.name,
                    g.pci_bus_id,
                    mem,
                    util,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.uuid,
                    procs
                );
            }
        }
    }
    match &inv.nvml {
        Ok(snap) => {
            let shown: Vec<usize> = inv
                .gpus()
                .iter()
                .filter_map(|g| g.physical.as_ref().map(|p| p.index))
                .collect();
            let hidden: Vec<String> = snap
                .gpus
                .iter()
                .filter(|p| !shown.contains(&p.index))
                .map(|p| format!("{} ({}, {})", p.index, p.name, p.pci_bus_id))
                .collect();
            if !hidden.is_empty() {
                crate::out!(
                    "not visible to this process (NVML): physical GPU {}",
                    hidden.join(", ")
                );
            }
            for (a, b, link) in &snap.links {
                crate::out!("link: physical GPU {a} <-> {b}: {link:?}");
            }
        }
        Err(e) => crate::out!("NVML: {e} (physical indices, free memory and processes unknown)"),
    }
    if let Some(p) = planned {
        match p {
            Ok((plan, notes)) => {
                for n in notes {
                    crate::out!("warning: {n}");
                }
                crate::out!("this config would use: {}", plan.describe());
            }
            Err(e) => crate::out!("this config cannot run: {e}"),
        }
    }
    crate::out!("kernel cache: {}", cache.display());
    Ok(ExitCode::SUCCESS)
}
