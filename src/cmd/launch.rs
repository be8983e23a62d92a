//! `kiln launch`: a multi-process run. One `kiln train` process per GPU (or `--nproc`
//! on the CPU), each told its rank through the environment (`device::world`) and shown
//! only its own GPU by UUID, all watched together: when one fails, the others are
//! stopped and every process restarts from the run's latest checkpoint, without a
//! failed GPU when others remain (the global batch stays; each process takes a larger
//! shard), up to `--max-restarts` times. With `--srun`, one `srun` step inside a Slurm
//! allocation takes the place of the local processes. Like the supervisor, it never
//! trains and never touches a GPU beyond probing which ones there are.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cli::{LaunchArgs, TrainArgs};
use crate::device::DevicePlan;
use crate::device::world::{
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
};
use crate::exit::UsageError;
use crate::run::failure::{RankProcess, UsedDevice, take_failure, write_ranks};
use crate::run::ranks::{Exit, attempt_code, process_count};
use crate::run::supervisor::{Decision, decide};

/// After the first process of an attempt fails, how long the others get to notice
/// (they normally do at once: their link to it closed) before they are killed.
const GRACE: Duration = Duration::from_secs(30);

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let train = &args.train;
    if train.no_supervisor || train.supervised || train.run_dir.is_some() {
        return Err(UsageError(
            "kiln launch watches and restarts its processes itself; drop --no-supervisor".into(),
        )
        .into());
    }
    // Mistakes in the config end here, before any process starts; every attempt and
    // every rank shares one run dir.
    let (resume_dir, config, name, _notes) = super::train::resolve(train)?;
    let run_dir = match &resume_dir {
        Some(dir) => dir.clone(),
        None => super::train::create_run_dir(&train.output, &name)?,
    };
    // Interrupts reach the processes too (one process group); they agree on a step,
    // checkpoint and exit 130, and nothing is restarted.
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let _ = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst));
    let exe = std::env::current_exe().context("finding the kiln executable to start training")?;

    let mut used = if args.srun {
        Vec::new()
    } else {
        let gpus = match super::plan_devices(&config.devices)? {
            DevicePlan::Cuda { gpus, .. } => Some(
                gpus.iter()
                    .map(|g| UsedDevice {
                        name: format!("cuda:{} {}", g.ordinal, g.name),
                        uuid: g.uuid.clone(),
                    })
                    .collect::<Vec<_>>(),
            ),
            DevicePlan::Cpu { .. } => None,
        };
        let n = process_count(args.nproc, gpus.as_ref().map(Vec::len)).map_err(UsageError)?;
        match gpus {
            Some(g) => g.into_iter().take(n).collect(),
            None => vec![
                UsedDevice {
                    name: "cpu".into(),
                    uuid: String::new(),
                };
                n
            ],
        }
    };

    for attempt in 0.. {
        let code = if args.srun {
            srun_attempt(&exe, &args, &run_dir)?
        } else {
            local_attempt(&exe, &args, &run_dir, &used, &interrupted)?
        };
        if interrupted.load(Ordering::SeqCst) {
            return Ok(exit_code(code.unwrap_or(130)));
        }
        let failure = take_failure(&run_dir);
        match decide(code, failure.as_ref(), &used, attempt, train.max_restarts) {
            Decision::Finish(code) => {
                if code != 0 && attempt >= train.max_restarts && matches!(code, 75 | 101) {
                    eprintln!(
                        "kiln: launch: giving up after {attempt} restart(s) (--max-restarts {})",
                        train.max_restarts
                    );
                }
                return Ok(exit_code(code));
            }
            Decision::Restart { devices, why } => {
                eprintln!(
                    "kiln: launch: {why} (restart {} of {}, every process from the latest checkpoint in {})",
                    attempt + 1,
                    train.max_restarts,
                    run_dir.display()
                );
                if let Some(devices) = devices {
                    used = devices;
                }
            }
        }
    }
    unreachable!("the loop returns")
}

/// `kiln train` for one attempt: the run dir to start or resume, and the user's config.
fn train_command(exe: &Path, train: &TrainArgs, run_dir: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("train").arg("--output").arg(&train.output);
    if let Some(c) = &train.config {
        cmd.arg("--config").arg(c);
    }
    for s in &train.sets {
        cmd.arg("--set").arg(s);
    }
    if run_dir.join("checkpoints").join("latest").is_file() {
        cmd.arg("--resume").arg(run_dir);
    } else {
        cmd.arg("--run-dir").arg(run_dir);
    }
    cmd
}

/// One process per entry of `used` on this machine; their exits, in the order they came.
fn local_attempt(
    exe: &Path,
    args: &LaunchArgs,
    run_dir: &Path,
    used: &[UsedDevice],
    interrupted: &AtomicBool,
) -> anyhow::Result<Option<i32>> {
    let port = match args.port {
        Some(p) => p,
        None => free_port().context("finding a free TCP port for rank 0")?,
    };
    let n = used.len();
    eprintln!(
        "kiln: launch: {n} process(es), rank 0 listening on port {port}: {}",
        used.iter()
            .enumerate()
            .map(|(r, d)| format!("rank {r} {}", d.name))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut echoes = Vec::new();
    for (rank, device) in used.iter().enumerate() {
        let mut cmd = train_command(exe, &args.train, run_dir);
        cmd.env(RANK, rank.to_string())
            .env(WORLD_SIZE, n.to_string())
            .env(LOCAL_RANK, rank.to_string())
            .env(LOCAL_WORLD_SIZE, n.to_string())
            .env(MASTER_ADDR, "127.0.0.1")
            .env(MASTER_PORT, port.to_string());
        if !device.uuid.is_empty() {
            // Its own GPU only, named by UUID: no renumbering can give it another
            // rank's. The config's own `devices.visible` would contradict it.
            cmd.env("CUDA_VISIBLE_DEVICES", &device.uuid)
                .arg("--set")
                .arg("devices.visible=\"\"");
        }
        // Through the launcher, whole lines at a time, so that the processes' lines do
        // not cut into each other; rank 0 keeps a terminal for its progress bar.
        if rank > 0 || !std::io::stderr().is_terminal() {
            cmd.stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(e).context("starting a training process");
            }
        };
        if let Some(err) = child.stderr.take() {
            let prefix = if rank > 0 {
                format!("rank {rank}: ")
            } else {
                String::new()
            };
            echoes.push(std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let _ = std::io::stderr().write_all(format!("{prefix}{line}\n").as_bytes());
                }
            }));
        }
        children.push((rank, child));
    }
    let record: Vec<RankProcess> = children
        .iter()
        .map(|(rank, c)| RankProcess {
            rank: *rank,
            pid: c.id(),
            device: used[*rank].name.clone(),
        })
        .collect();
    if let Err(e) = write_ranks(run_dir, &record) {
        eprintln!(
            "kiln: warning: cannot record the processes in {}: {e}",
            run_dir.display()
        );
    }
    let exits = watch(children, interrupted);
    for e in echoes {
        let _ = e.join();
    }
    for (rank, code) in &exits {
        if *code != Some(0) {
            eprintln!(
                "kiln: launch: rank {rank} ({}) {}",
                used[*rank].name,
                match code {
                    Some(c) => format!("exited with {c}"),
                    None => "was killed".into(),
                }
            );
        }
    }
    Ok(attempt_code(&exits))
}

/// Waits for every process; once one has failed, the rest get [`GRACE`] to end on
/// their own, then are killed.
fn watch(mut running: Vec<(usize, Child)>, interrupted: &AtomicBool) -> Vec<Exit> {
    let mut exits: Vec<Exit> = Vec::new();
    let mut failed_at: Option<Instant> = None;
    while !running.is_empty() {
        running.retain_mut(|(rank, child)| match child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                exits.push((*rank, status.code()));
                false
            }
            Err(_) => {
                exits.push((*rank, None));
                false
            }
        });
        if failed_at.is_none() && exits.iter().any(|(_, c)| *c != Some(0)) {
            failed_at = Some(Instant::now());
        }
        // An interrupt gives the processes the same grace to checkpoint.
        if failed_at.is_none() && interrupted.load(Ordering::SeqCst) {
            failed_at = Some(Instant::now());
        }
        if failed_at.is_some_and(|t| t.elapsed() > GRACE) && !running.is_empty() {
            eprintln!(
                "kiln: launch: stopping rank(s) {} still running {} s after the first failure",
                running
                    .iter()
                    .map(|(r, _)| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                GRACE.as_secs()
            );
            stop(&mut running);
            for (rank, child) in &mut running {
                exits.push((*rank, child.wait().ok().and_then(|s| s.code())));
            }
            running.clear();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    exits
}

fn stop(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
    }
}

/// One `srun` step of the allocation's tasks; each task reads its rank from Slurm.
/// srun ends the step when a task fails (`--kill-on-bad-exit`) and exits with the
/// failing task's code (128 + the signal for one killed by a signal).
fn srun_attempt(exe: &Path, args: &LaunchArgs, run_dir: &Path) -> anyhow::Result<Option<i32>> {
    let train = train_command(exe, &args.train, run_dir);
    let mut cmd = Command::new("srun");
    cmd.arg("--kill-on-bad-exit=1").args(&args.srun_args);
    cmd.arg(train.get_program()).args(train.get_args());
    eprintln!("kiln: launch: srun step for {}", run_dir.display());
    let status = cmd.status().map_err(|e| {
        UsageError(format!(
            "kiln launch --srun cannot start srun ({e}); run it inside a Slurm allocation (sbatch or salloc) on a node with Slurm's client"
        ))
    })?;
    Ok(match status.code() {
        // A task killed by a signal: as the local launcher reports one.
        Some(c) if c > 128 && c != 130 => None,
        c => c,
    })
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
