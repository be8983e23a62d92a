//! `kiln train --dry-run`: what `kiln train` would check and use before training (the
//! config as resolved, the devices, the data, every image read once), printed; nothing
//! trained, no run dir made or locked.

use std::process::ExitCode;

use super::setup::{kernel_settings, plan_devices, resolve_train};
use super::train::{as_recorded, open_data, refuse_unrepeatable};
use crate::cli::TrainArgs;
use crate::config;

pub fn run(args: &TrainArgs) -> anyhow::Result<ExitCode> {
    let resolved = resolve_train(args)?;
    for note in &resolved.notes {
        crate::say!("kiln: note: {note}");
    }
    let config = resolved.config;
    let plan = plan_devices(&config.devices)?;
    refuse_unrepeatable(&config, &plan)?;
    kernel_settings(&config, &plan)?;
    crate::say!("kiln: devices: {}", plan.device_names().join(", "));
    let dataset = open_data(&config)?;
    match &resolved.resume_dir {
        Some(dir) => crate::say!("kiln: would resume {}", dir.display()),
        None => crate::say!(
            "kiln: would make a run dir {}/{}-<time>",
            args.output.display(),
            resolved.name
        ),
    }
    crate::out!("{}", config::to_toml(&as_recorded(&config, &dataset)));
    crate::say!("kiln: dry run: nothing trained");
    Ok(ExitCode::SUCCESS)
}
