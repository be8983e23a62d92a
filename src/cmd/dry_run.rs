//! `kiln train --dry-run`: what `kiln train` would check and use before training (the
//! config as resolved, the devices, the data, every image read once), printed; nothing
//! trained, no run dir made or locked.

use std::process::ExitCode;

use super::setup::{kernel_settings, plan_devices, resolve_train};
use super::train::{check_images, refuse_unrepeatable};
use crate::cli::TrainArgs;
use crate::config;

pub fn run(args: &TrainArgs) -> anyhow::Result<ExitCode> {
    let resolved = resolve_train(args)?;
    for note in &resolved.notes {
        crate::say!("kiln: note: {note}");
    }
    let mut config = resolved.config;
    let plan = plan_devices(&config.devices)?;
    refuse_unrepeatable(&config, &plan)?;
    kernel_settings(&config, &plan)?;
    crate::say!("kiln: devices: {}", plan.device_names().join(", "));
    let dataset = crate::data::open(&config.data, config.train.seed)?;
    check_images(&dataset, &config)?;
    crate::say!(
        "kiln: data: {:?}, {} train / {} test images, {}x{}x{}, {} classes",
        config.data.dataset,
        dataset.train.len(),
        dataset.test.len(),
        dataset.shape().channels,
        dataset.shape().height,
        dataset.shape().width,
        dataset.classes.len()
    );
    match &resolved.resume_dir {
        Some(dir) => crate::say!("kiln: would resume {}", dir.display()),
        None => crate::say!(
            "kiln: would make a run dir {}/{}-<time>",
            args.output.display(),
            resolved.name
        ),
    }
    // The config as the run would record it: the dataset's absolute location included.
    config.data.root = dataset.root.display().to_string();
    crate::out!("{}", config::to_toml(&config));
    crate::say!("kiln: dry run: nothing trained");
    Ok(ExitCode::SUCCESS)
}
