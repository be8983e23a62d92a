//! `kiln train` under the supervisor: trains in a child process (`kiln train
//! --supervised`) and restarts it from the latest checkpoint when it fails in a way
//! that may pass (see `run::supervisor`). The supervisor never touches CUDA.

use std::path::Path;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;

use crate::cli::TrainArgs;
use crate::run::failure::{read_devices, take_failure};
use crate::run::supervisor::{Decision, decide};

pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    // Check the config and find or make the run dir here, so mistakes end before any
    // child starts and every attempt shares one run dir.
    let (resume_dir, _config, name, _notes) = super::train::resolve(&args)?;
    let run_dir = match &resume_dir {
        Some(dir) => dir.clone(),
        None => super::train::create_run_dir(&args.output, &name)?,
    };
    // Interrupts reach the child too (same process group); it checkpoints and exits
    // 130. The supervisor only notes them so it does not restart.
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let _ = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst));

    let exe = std::env::current_exe().context("finding the kiln executable to start training")?;
    let mut restart_sets: Vec<String> = Vec::new();
    let mut visible: Option<String> = None;
    for attempt in 0.. {
        let mut cmd = Command::new(&exe);
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
        // After a GPU was left out, the surviving set replaces --devices.
        if let (Some(d), None) = (&args.devices, &visible) {
            cmd.arg("--devices").arg(d);
        }
        for s in &restart_sets {
            cmd.arg("--set").arg(s);
        }
        if has_checkpoint(&run_dir) {
            cmd.arg("--resume").arg(&run_dir);
        } else {
            cmd.arg("--run-dir").arg(&run_dir);
        }
        if let Some(v) = &visible {
            cmd.env("CUDA_VISIBLE_DEVICES", v);
        }
        let status = cmd.status().context("starting the training process")?;
        if interrupted.load(Ordering::SeqCst) {
            return Ok(exit_code(status.code().unwrap_or(130)));
        }
        let failure = take_failure(&run_dir);
        let used = read_devices(&run_dir);
        match decide(
            status.code(),
            failure.as_ref(),
            &used,
            attempt,
            args.max_restarts,
        ) {
            Decision::Finish(code) => {
                if code != 0 && attempt >= args.max_restarts && matches!(code, 75 | 101) {
                    eprintln!(
                        "kiln: supervisor: giving up after {attempt} restart(s) (--max-restarts {})",
                        args.max_restarts
                    );
                }
                return Ok(exit_code(code));
            }
            Decision::Restart { devices, why } => {
                eprintln!(
                    "kiln: supervisor: {why} (restart {} of {}, from the latest checkpoint in {})",
                    attempt + 1,
                    args.max_restarts,
                    run_dir.display()
                );
                if let Some(devices) = devices {
                    let uuids: Vec<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
                    let list = uuids.join(",");
                    // Same global batch on fewer GPUs: each takes a larger shard.
                    restart_sets = vec![
                        format!("devices.visible={list}"),
                        "devices.use=all".into(),
                        "devices.main=0".into(),
                        "train.device_weights=[]".into(),
                    ];
                    visible = Some(list);
                }
            }
        }
    }
    unreachable!("the loop returns")
}

fn has_checkpoint(run_dir: &Path) -> bool {
    run_dir.join("checkpoints").join("latest").is_file()
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
