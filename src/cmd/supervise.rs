//! `kiln train` under the supervisor: trains in a child process (`kiln train
//! --supervised`) and restarts it from the latest checkpoint when it fails in a way
//! that may pass (`run::restart`). The supervisor never touches CUDA; it owns the run
//! dir (its lock) for the children it starts, and passes a SIGTERM or SIGINT on to
//! the child, which checkpoints and exits.

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::Context;

use super::setup::resolve_train;
use crate::cli::TrainArgs;
use crate::run::failure::read_devices;
use crate::run::restart::{Ended, run_attempts};
use crate::run::run_dir::{self, LOG_FILE};
use crate::run::signals::Signals;

pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    // Check the config and find or make the run dir here, so mistakes end before any
    // child starts and every attempt shares one run dir.
    let resolved = resolve_train(&args)?;
    let run_dir = match &resolved.resume_dir {
        Some(dir) => dir.clone(),
        None => run_dir::create(&args.output, &resolved.name)?,
    };
    let (lock, note) = run_dir::lock(&run_dir)?;
    if let Some(n) = note {
        crate::say!("kiln: note: {n}");
    }
    let signals = Signals::for_supervisor();
    let _ = crate::console::log_to(&run_dir.join(LOG_FILE));
    let exe = std::env::current_exe().context("finding the kiln executable to start training")?;
    let code = run_attempts(
        "supervisor",
        &run_dir,
        args.max_restarts,
        signals.interrupted(),
        |survivors| -> anyhow::Result<Ended> {
            let mut cmd = child_command(&exe, &args, &run_dir);
            // After a GPU was left out, the surviving set replaces --devices: the same
            // global batch on fewer GPUs, each taking a larger shard.
            if let Some(devices) = survivors {
                let list = devices
                    .iter()
                    .map(|d| d.uuid.as_str())
                    .collect::<Vec<_>>()
                    .join(",");
                for s in [
                    format!("devices.visible={list}"),
                    "devices.use=all".into(),
                    "devices.main=0".into(),
                    "parallel.device_weights=[]".into(),
                ] {
                    cmd.arg("--set").arg(s);
                }
                cmd.env("CUDA_VISIBLE_DEVICES", &list);
            } else if let Some(d) = &args.devices {
                cmd.arg("--devices").arg(d);
            }
            let child = signals
                .spawn(&mut cmd)
                .context("starting the training process")?;
            let code = signals.wait(child)?;
            Ok(Ended {
                code,
                used: read_devices(&run_dir),
            })
        },
    )?;
    // A run that never got to train (a usage, config or data error, no usable GPU)
    // leaves no empty run dir behind; anything it wrote beyond its start keeps it.
    if matches!(code, 2 | 75) && resolved.resume_dir.is_none() {
        drop(lock);
        run_dir::discard_unstarted(&run_dir);
    }
    Ok(exit_code(code))
}

/// `kiln train --supervised` for one attempt: the run dir to start or resume.
fn child_command(exe: &Path, args: &TrainArgs, run_dir: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("train")
        .arg("--supervised")
        .arg("--output")
        .arg(&args.output);
    if let Some(c) = &args.config {
        cmd.arg("--config").arg(c);
    }
    for s in &args.sets {
        cmd.arg("--set").arg(s);
    }
    if run_dir::has_checkpoint(run_dir) {
        cmd.arg("--resume").arg(run_dir);
    } else {
        cmd.arg("--run-dir").arg(run_dir);
    }
    cmd
}

pub fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
