//! The one CLI test binary: runs the real `kiln` executable on the CPU, on fixtures
//! the tests make themselves.
//!
//! Plain `std::process::Command` rather than assert_cmd/predicates/tempfile: those
//! dev-dependencies turn on features of crates Burn depends on, and then `cargo test`
//! and `cargo build` would each compile Burn.

use std::path::{Path, PathBuf};
use std::process::Command;

mod reliability;
mod trained_model;

const DEBUG_TOML: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/debug.toml");

fn kiln() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    // No GPU for tests, whatever the machine has, and a cache of the tests' own.
    cmd.env("CUDA_VISIBLE_DEVICES", "");
    cmd.env(
        "KILN_CACHE_DIR",
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("kiln-cache"),
    );
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

/// What a finished `kiln` printed and returned.
struct Output {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Output {
    fn of(cmd: &mut Command) -> Output {
        let out = cmd.output().expect("the kiln binary should start");
        Output {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code, code,
            "exit code\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }

    fn success(&self) -> &Self {
        self.code(0)
    }

    fn stderr_has(&self, text: &str) -> &Self {
        assert!(
            self.stderr.contains(text),
            "stderr lacks {text:?}:\n{}",
            self.stderr
        );
        self
    }

    fn stderr_lacks(&self, text: &str) -> &Self {
        assert!(
            !self.stderr.contains(text),
            "stderr has {text:?}:\n{}",
            self.stderr
        );
        self
    }

    fn stdout_has(&self, text: &str) -> &Self {
        assert!(
            self.stdout.contains(text),
            "stdout lacks {text:?}:\n{}",
            self.stdout
        );
        self
    }
}

/// A fresh directory in cargo's scratch space for integration tests.
fn tempdir(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The single run directory under `out`.
fn run_dir(out: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(
        dirs.len(),
        1,
        "expected one run dir in {}: {dirs:?}",
        out.display()
    );
    dirs[0].clone()
}

fn train(out: &Path, sets: &[&str]) -> Output {
    let mut cmd = kiln();
    cmd.args(["train", "--config", DEBUG_TOML, "--output"])
        .arg(out);
    for s in sets {
        cmd.args(["--set", s]);
    }
    Output::of(&mut cmd)
}

/// `kiln sweep --config FILE --output OUT`.
fn run_sweep(file: &Path, out: &Path) -> Output {
    Output::of(
        kiln()
            .args(["sweep", "--config"])
            .arg(file)
            .arg("--output")
            .arg(out),
    )
}

fn metrics(run: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(run.join("metrics.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(String::from).collect())
        .collect()
}

#[test]
fn help_and_version_work_without_a_gpu() {
    Output::of(kiln().arg("--help"))
        .success()
        .stdout_has("train");
    Output::of(kiln().args(["train", "--help"]))
        .success()
        .stdout_has("--resume");
    Output::of(kiln().arg("--version"))
        .success()
        .stdout_has(env!("CARGO_PKG_VERSION"));
}

#[test]
fn unknown_set_key_is_a_usage_error_naming_key_and_suggestion() {
    let out = tempdir("unknown-key");
    train(&out, &["train.batch_szie=32"])
        .code(2)
        .stderr_has("train.batch_szie")
        .stderr_has("did you mean `train.batch_size`");
}

#[test]
fn bad_value_is_a_usage_error_naming_the_value() {
    let out = tempdir("bad-value");
    train(&out, &["optim.lr=-1"])
        .code(2)
        .stderr_has("optim.lr = -1");
    train(&out, &["train.epochs=many"])
        .code(2)
        .stderr_has("train.epochs = \"many\"");
    train(&out, &["devices.use=some"])
        .code(2)
        .stderr_has("a list of logical GPU indices");
}

#[test]
fn missing_config_file_and_missing_data_are_usage_errors() {
    Output::of(kiln().args(["train", "--config", "no/such.toml"]))
        .code(2)
        .stderr_has("no/such.toml");
    let out = tempdir("missing-data");
    train(
        &out,
        &[
            "data.dataset=fashion_mnist",
            "data.root=/nonexistent/fmnist",
        ],
    )
    .code(2)
    .stderr_has("/nonexistent/fmnist");
}

#[test]
fn training_writes_a_complete_run_dir_and_the_loss_falls() {
    let out = tempdir("complete");
    train(&out, &["train.epochs=4"])
        .success()
        .stderr_has("training on the CPU")
        .stderr_has("finished 4 epochs");
    let run = run_dir(&out);
    for f in [
        "config.toml",
        "metrics.csv",
        "summary.json",
        "curves.png",
        "checkpoints/latest",
    ] {
        assert!(run.join(f).is_file(), "{f} missing");
    }
    // TensorBoard's event file, with the test accuracy among its tags (the format and
    // its checksums are tested in report::tensorboard).
    let events: Vec<PathBuf> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("events.out.tfevents."))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let bytes = std::fs::read(&events[0]).unwrap();
    assert!(bytes.windows(13).any(|w| w == b"test/accuracy"));
    let rows = metrics(&run);
    assert_eq!(rows.len(), 4);
    let loss = |r: &Vec<String>| r[3].parse::<f64>().unwrap();
    assert!(
        loss(&rows[3]) < 0.8 * loss(&rows[0]),
        "loss did not fall: {rows:?}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "finished");
    assert_eq!(summary["epochs_completed"], 4);
    assert!(
        summary["final_test_acc"].as_f64().unwrap() > 0.5,
        "{summary}"
    );
    // The resolved config parses back and records every section.
    let resolved = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        resolved.contains("[checkpoint]") && resolved.contains("epochs = 4"),
        "{resolved}"
    );

    Output::of(kiln().args(["eval", "--run"]).arg(&run))
        .success()
        .stdout_has("test split")
        .stdout_has("64 images");
    // The run's config with overrides; [model] keys cannot apply to a trained model.
    Output::of(
        kiln()
            .args(["eval", "--run"])
            .arg(&run)
            .args(["--set", "data.synthetic_test_size=32"]),
    )
    .success()
    .stdout_has("32 images");
    Output::of(
        kiln()
            .args(["eval", "--run"])
            .arg(&run)
            .args(["--set", "model.arch=resnet18"]),
    )
    .code(2)
    .stderr_has("[model] keys cannot change it");
}

#[test]
fn quiet_shows_only_problems_and_verbose_shows_details_the_log_keeps_all() {
    let out = tempdir("verbosity");
    let o = Output::of(
        kiln()
            .args(["--quiet", "train", "--config", DEBUG_TOML, "--output"])
            .arg(out.join("quiet")),
    );
    o.success();
    assert_eq!(o.stderr.trim(), "", "{}", o.stderr);
    let log = std::fs::read_to_string(run_dir(&out.join("quiet")).join("train.log")).unwrap();
    assert!(
        log.contains("finished 3 epochs") && log.contains("test pass of epoch 1"),
        "{log}"
    );
    // A problem still shows.
    Output::of(
        kiln()
            .args([
                "train",
                "-q",
                "--config",
                DEBUG_TOML,
                "--set",
                "optim.lr=-1",
            ])
            .arg("--output")
            .arg(out.join("bad")),
    )
    .code(2)
    .stderr_has("optim.lr = -1");
    Output::of(
        kiln()
            .args(["train", "--verbose", "--config", DEBUG_TOML, "--output"])
            .arg(out.join("verbose")),
    )
    .success()
    .stderr_has("finished 3 epochs")
    .stderr_has("test pass of epoch 1")
    .stderr_has("checkpoint at step");
    // Without either, details stay in the log.
    train(&out.join("normal"), &[])
        .success()
        .stderr_has("finished 3 epochs")
        .stderr_lacks("test pass of epoch");
}

#[test]
fn a_run_stopped_mid_epoch_resumes_where_it_stopped() {
    // Steps per epoch: 256 / 32 = 8. Stop mid-epoch 2 (step 11), resume to the end.
    // (That the result is bitwise the uninterrupted run is tested in train::trainer.)
    let parts = tempdir("mid-epoch");
    train(&parts, &["train.epochs=2", "train.max_steps=11"])
        .success()
        .stderr_has("stopped at step 11");
    let run = run_dir(&parts);
    Output::of(
        kiln()
            .args([
                "train",
                "--config",
                DEBUG_TOML,
                "--set",
                "train.epochs=2",
                "--resume",
            ])
            .arg(&run),
    )
    .success()
    .stderr_has("resuming from")
    .stderr_has("step 11")
    .stderr_has("finished 2 epochs");
    assert_eq!(metrics(&run).len(), 2);
    assert!(run.join("checkpoints/step-000000016/model.bin").is_file());
}

#[test]
fn resume_refuses_a_different_model_and_names_the_key() {
    let out = tempdir("refuse");
    train(&out, &["train.epochs=1"]).success();
    let run = run_dir(&out);
    Output::of(
        kiln()
            .args([
                "train",
                "--config",
                DEBUG_TOML,
                "--set",
                "model.arch=resnet20",
                "--resume",
            ])
            .arg(&run),
    )
    .code(2)
    .stderr_has("model.arch");
}

#[test]
fn corrupt_latest_checkpoint_is_skipped_for_the_previous_one() {
    let out = tempdir("corrupt");
    train(&out, &["train.epochs=2"]).success();
    let run = run_dir(&out);
    let latest = run.join("checkpoints/step-000000016/model.bin");
    let bytes = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, &bytes[..bytes.len() / 2]).unwrap();
    Output::of(
        kiln()
            .args(["train", "--set", "train.epochs=3", "--resume"])
            .arg(&run),
    )
    .success()
    .stderr_has("skipping")
    .stderr_has("step-000000016")
    .stderr_has("resuming from");
}

#[test]
fn resume_without_checkpoints_is_a_usage_error() {
    let out = tempdir("no-checkpoints");
    Output::of(
        kiln()
            .args(["train", "--config", DEBUG_TOML, "--output"])
            .arg(&out)
            .arg("--resume"),
    )
    .code(2)
    .stderr_has("no run of");
}

#[test]
fn cuda_backend_without_a_gpu_is_reported_not_a_panic() {
    let out = tempdir("no-gpu");
    train(&out, &["devices.backend=cuda"])
        .code(75)
        .stderr_has("no GPU can be used")
        .stderr_lacks("panicked");
    train(&out, &["devices.backend=auto", "devices.require_gpu=true"])
        .code(75)
        .stderr_has("devices.require_gpu");
}

#[test]
fn a_misspelt_visible_devices_variable_is_a_usage_error() {
    let out = tempdir("typo");
    let mut cmd = kiln();
    cmd.env_remove("CUDA_VISIBLE_DEVICES")
        .env("CUDA_VISBLE_DEVICES", "1");
    cmd.args(["train", "--config", DEBUG_TOML, "--output"])
        .arg(&out);
    cmd.args(["--set", "devices.backend=auto"]);
    Output::of(&mut cmd)
        .code(2)
        .stderr_has("CUDA_VISBLE_DEVICES=\"1\"")
        .stderr_has("rename it to CUDA_VISIBLE_DEVICES");
}

#[test]
fn devices_command_reports_without_a_gpu() {
    Output::of(kiln().arg("devices"))
        .success()
        .stdout_has("CUDA_VISIBLE_DEVICES=\"\"")
        .stdout_has("training runs on the CPU");
    Output::of(kiln().args(["devices", "--json"]))
        .success()
        .stdout_has("\"gpus\"");
    Output::of(kiln().args(["devices", "--config", DEBUG_TOML]))
        .success()
        .stdout_has("this config would use: cpu");
    // CUDA_VISIBLE_DEVICES="" is set for tests, so a config asking for "1" conflicts.
    Output::of(kiln().args(["devices", "--set", "devices.visible=1"]))
        .code(2)
        .stderr_has("devices.visible = \"1\"")
        .stderr_has("CUDA_VISIBLE_DEVICES=\"\"");
}

#[test]
fn image_folder_dataset_trains() {
    let data = tempdir("folder-data");
    for split in ["train", "test"] {
        for (c, class) in ["red", "blue"].iter().enumerate() {
            let dir = data.join(split).join(class);
            std::fs::create_dir_all(&dir).unwrap();
            for i in 0..8u8 {
                let px = if c == 0 {
                    [200, i * 4, 10]
                } else {
                    [10, i * 4, 200]
                };
                image::RgbImage::from_pixel(10, 10, image::Rgb(px))
                    .save(dir.join(format!("{i}.png")))
                    .unwrap();
            }
        }
    }
    let out = tempdir("folder-out");
    let root = format!("data.root={}", data.display());
    train(
        &out,
        &[
            "data.dataset=image_folder",
            &root,
            "train.batch_size=4",
            "train.epochs=2",
            "data.image_size=8",
        ],
    )
    .success()
    .stderr_has("16 train / 16 test images, 3x8x8, 2 classes");
}

fn summary(run: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn the_supervisor_restarts_a_failed_run_which_ends_as_an_uninterrupted_one() {
    let plain = tempdir("sup-plain");
    train(&plain, &["checkpoint.every_steps=2"]).success();
    let failed = tempdir("sup-error");
    train(
        &failed,
        &[
            "checkpoint.every_steps=2",
            "faults.inject=error",
            "faults.step=5",
        ],
    )
    .success()
    .stderr_has("replica on cpu failed at step 5")
    .stderr_has("supervisor: cpu failed at step 5")
    .stderr_has("restart 1 of 3")
    .stderr_has("resuming from")
    .stderr_has("step-000000004");
    let (a, b) = (summary(&run_dir(&plain)), summary(&run_dir(&failed)));
    assert_eq!(a["final_test_loss"], b["final_test_loss"], "{a} vs {b}");
}

#[test]
fn the_supervisor_restarts_after_a_panic_and_after_a_hang() {
    let out = tempdir("sup-panic");
    train(
        &out,
        &[
            "checkpoint.every_steps=2",
            "faults.inject=panic",
            "faults.step=6",
        ],
    )
    .success()
    .stderr_has("the training process panicked; restarting")
    .stderr_has("finished 3 epochs");
    let out = tempdir("sup-hang");
    train(
        &out,
        &[
            "checkpoint.every_steps=2",
            "faults.inject=hang",
            "faults.step=6",
            "watchdog.hang_timeout_s=1",
        ],
    )
    .success()
    .stderr_has("step 6 hung on cpu")
    .stderr_has("cpu hung at step 6")
    .stderr_has("finished 3 epochs");
}

#[test]
fn without_restarts_left_the_failure_is_the_exit_code() {
    let out = tempdir("sup-none");
    let mut cmd = kiln();
    cmd.args([
        "train",
        "--config",
        DEBUG_TOML,
        "--max-restarts",
        "0",
        "--output",
    ])
    .arg(&out);
    cmd.args(["--set", "faults.inject=error", "--set", "faults.step=3"]);
    Output::of(&mut cmd)
        .code(75)
        .stderr_has("giving up after 0 restart(s)");
}

#[test]
fn an_unwritable_checkpoint_stops_training_and_keeps_the_previous_one() {
    let out = tempdir("disk");
    train(&out, &["train.epochs=2"]).success();
    let run = run_dir(&out);
    // Something that is not a directory where the next checkpoint's temporary
    // directory must go (root ignores permission bits, so no chmod here).
    std::fs::write(run.join("checkpoints/step-000000024.tmp"), "in the way").unwrap();
    Output::of(
        kiln()
            .args(["train", "--set", "train.epochs=3", "--resume"])
            .arg(&run),
    )
    .code(1)
    .stderr_has("checkpoint I/O failed")
    .stderr_has("step-000000024.tmp")
    .stderr_lacks("supervisor: ");
    assert!(
        run.join("checkpoints/step-000000016/manifest.json")
            .is_file()
    );
    Output::of(kiln().args(["eval", "--run"]).arg(&run))
        .success()
        .stdout_has("step-000000016");
}

/// The run dir under `out` once its checkpoint of `step` is complete (60 s at most).
fn wait_for_checkpoint(out: &Path, step: u64) -> PathBuf {
    let manifest = format!("checkpoints/step-{step:09}/manifest.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let found = std::fs::read_dir(out)
            .ok()
            .and_then(|mut d| d.next())
            .map(|e| e.unwrap().path())
            .filter(|r| r.join(&manifest).is_file());
        if let Some(r) = found {
            return r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the run never reached step {step}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn a_run_killed_with_sigkill_resumes_and_ends_as_an_uninterrupted_one() {
    let plain = tempdir("kill-plain");
    train(&plain, &["checkpoint.every_steps=2"]).success();
    // Hold the run inside step 7 (an injected hang the watchdog would only notice
    // after 10 minutes), then kill -9 it.
    let out = tempdir("kill");
    let mut child = kiln()
        .args([
            "train",
            "--no-supervisor",
            "--config",
            DEBUG_TOML,
            "--output",
        ])
        .arg(&out)
        .args([
            "--set",
            "checkpoint.every_steps=2",
            "--set",
            "faults.inject=hang",
        ])
        .args([
            "--set",
            "faults.step=7",
            "--set",
            "watchdog.hang_timeout_s=600",
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let run = wait_for_checkpoint(&out, 6);
    std::thread::sleep(std::time::Duration::from_millis(300));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    Output::of(
        kiln()
            .args(["train", "--no-supervisor", "--resume"])
            .arg(&run),
    )
    .success()
    .stderr_has("step-000000006");
    assert_eq!(
        summary(&run_dir(&plain))["final_test_loss"],
        summary(&run)["final_test_loss"]
    );
}

#[test]
fn a_sweep_runs_every_trial_records_a_failing_one_and_resumes() {
    let dir = tempdir("sweep");
    let file = dir.join("sweep.toml");
    // The last batch size is larger than the 256 training images: that trial fails
    // when it starts, the others train.
    std::fs::write(
        &file,
        format!(
            "base = {DEBUG_TOML:?}\nmax_restarts = 0\nset = [\"train.epochs=1\"]\n[grid]\n\"train.batch_size\" = [16, 32, 64, 100000]\n"
        ),
    )
    .unwrap();
    let out = dir.join("sweeps");
    let o = run_sweep(&file, &out);
    o.code(1)
        .stderr_has("4 trials")
        .stderr_has("trial 3 failed (exit 2)")
        .stdout_has("best: trial");
    let sweep = run_dir(&out);
    let csv = std::fs::read_to_string(sweep.join("results.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 4, "{csv}");
    assert!(
        rows[..3].iter().all(|r| r.contains(",finished,0,")),
        "{csv}"
    );
    assert!(rows[3].starts_with("3,failed,2,"), "{csv}");
    assert!(rows[3].contains("batch"), "the log tail says why: {csv}");
    assert!(sweep.join("metric.png").is_file());
    let best = std::fs::read_to_string(sweep.join("best.toml")).unwrap();
    assert!(best.contains("batch_size"), "{best}");

    // --resume keeps the finished trials and runs the failed one again.
    let o = Output::of(kiln().args(["sweep", "--resume"]).arg(&sweep));
    o.code(1)
        .stderr_has("trial 0 finished earlier, skipped")
        .stderr_has("trial 2 finished earlier, skipped")
        .stderr_has("trial 3 failed (exit 2)");
    // A typo in an axis stops the sweep before anything runs.
    std::fs::write(
        &file,
        format!("base = {DEBUG_TOML:?}\n[grid]\n\"optim.lrr\" = [0.1]\n"),
    )
    .unwrap();
    run_sweep(&file, &dir.join("none"))
        .code(2)
        .stderr_has("did you mean `optim.lr`");
    assert!(!dir.join("none").exists());
}

/// Epochs each trial of a sweep trained: the rows of its `metrics.csv`.
fn epochs_trained(sweep: &Path) -> Vec<usize> {
    let mut trials: Vec<PathBuf> = std::fs::read_dir(sweep)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("trial-")
        })
        .collect();
    trials.sort();
    trials
        .iter()
        .map(|t| metrics(&run_dir_in(t)).len())
        .collect()
}

/// The run dir inside a trial's folder.
fn run_dir_in(trial: &Path) -> PathBuf {
    std::fs::read_dir(trial)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("config.toml").is_file())
        .unwrap()
}

#[test]
fn an_asha_sweep_finds_the_grids_best_trial_training_fewer_epochs() {
    let dir = tempdir("asha");
    // One trial at a time, so the order in which trials reach a rung (and with it every
    // decision) is the same on every run.
    let common = format!(
        "base = {DEBUG_TOML:?}\nmax_parallel = 1\nset = [\"train.epochs=9\", \"data.synthetic_train_size=512\"]\n"
    );
    let grid = "[grid]\n\"optim.lr\" = [0.0005, 0.002, 0.05, 0.001, 0.1]\n";
    let asha = "[asha]\nmin_epochs = 1\nreduction = 3\n";
    let mut best = Vec::new();
    let mut epochs = Vec::new();
    for (name, body) in [
        ("grid", format!("{common}{grid}")),
        ("asha", format!("{common}{asha}{grid}")),
    ] {
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, body).unwrap();
        let out = dir.join(name);
        let o = run_sweep(&file, &out);
        o.success();
        let line = o
            .stdout
            .lines()
            .find(|l| l.starts_with("best: trial"))
            .unwrap();
        best.push(line.split(',').next().unwrap().to_string());
        let sweep = run_dir(&out);
        epochs.push(epochs_trained(&sweep));
        if name == "asha" {
            o.stderr_has("ASHA judges trials at epochs [1, 3]")
                .stderr_has("stopped by ASHA at epoch");
            let csv = std::fs::read_to_string(sweep.join("results.csv")).unwrap();
            assert!(csv.contains(",stopped by asha,"), "{csv}");
            // Resumed, a stopped trial stays stopped.
            Output::of(kiln().args(["sweep", "--resume"]).arg(&sweep))
                .success()
                .stderr_has("was stopped by ASHA earlier, skipped")
                .stderr_lacks("on CPU 0:");
        }
    }
    assert_eq!(best[0], best[1], "epochs per trial: {epochs:?}");
    assert_eq!(epochs[0], vec![9; 5]);
    let (grid_total, asha_total): (usize, usize) = (epochs[0].iter().sum(), epochs[1].iter().sum());
    assert!(asha_total < grid_total, "epochs per trial: {epochs:?}");
}

/// A stand-in for Slurm's client in `dir/bin`: `sbatch` runs every element of the
/// script's array at once, in order (as node `fake`, job 42) and records the array list;
/// `squeue` prints `dir/bin/queue.txt`.
fn fake_slurm(dir: &std::path::Path) -> std::path::PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let sbatch = r#"#!/bin/sh
script="$2"
spec=$(sed -n 's/^#SBATCH --array=\([^%]*\).*/\1/p' "$script")
echo "$spec" >> "$(dirname "$0")/arrays.txt"
for part in $(echo "$spec" | tr , ' '); do
  i=${part%-*}
  while [ "$i" -le "${part#*-}" ]; do
    SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_JOB_ID=42 SLURMD_NODENAME=fake sh "$script" > /dev/null 2>&1
    i=$((i + 1))
  done
done
echo 42
"#;
    let squeue = "#!/bin/sh\ncat \"$(dirname \"$0\")/queue.txt\" 2> /dev/null\nexit 0\n";
    for (name, text) in [("sbatch", sbatch), ("squeue", squeue)] {
        let path = bin.join(name);
        std::fs::write(&path, text).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    bin
}

#[test]
fn a_slurm_sweep_submits_waits_gathers_and_resubmits_only_what_is_not_queued() {
    let dir = tempdir("slurm-fake");
    let bin = fake_slurm(&dir);
    let file = dir.join("sweep.toml");
    std::fs::write(
        &file,
        format!(
            "base = {DEBUG_TOML:?}\ngpus_per_trial = 0\nmax_restarts = 0\nset = [\"train.epochs=1\"]\n[grid]\n\"train.batch_size\" = [16, 32, 100000]\n[slurm]\npartition = \"debug\"\n"
        ),
    )
    .unwrap();
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let sweep = |args: &[&str]| {
        let mut cmd = kiln();
        cmd.arg("sweep").args(args).env("PATH", &path);
        Output::of(&mut cmd)
    };
    let out = dir.join("sweeps");
    let (f, outs) = (file.to_str().unwrap(), out.to_str().unwrap());
    sweep(&["--config", f, "--output", outs, "--launcher", "slurm"])
        .code(1)
        .stderr_has("submitted 3 trial(s) (0-2) as Slurm job array 42")
        .stderr_has("trial 0 finished (exit 0)")
        .stderr_has("trial 2 failed (exit 2)");
    let run = run_dir(&out);
    let script = std::fs::read_to_string(run.join("slurm/submit-1.sh")).unwrap();
    assert!(script.contains("#SBATCH --partition=debug"), "{script}");
    let csv = std::fs::read_to_string(run.join("results.csv")).unwrap();
    assert!(csv.contains("fake (job 42_1)"), "{csv}");
    assert!(run.join("best.toml").is_file());

    // Trial 2 still queued: --resume (Slurm, since the sweep went there) waits for it
    // and submits nothing; a local resume is refused.
    let name = run.file_name().unwrap().to_str().unwrap();
    std::fs::write(
        bin.join("queue.txt"),
        format!("kiln-{name} 2\nkiln-other 0\n"),
    )
    .unwrap();
    let r = run.to_str().unwrap();
    let o = sweep(&["--resume", r, "--no-wait"]);
    assert!(!o.stderr.contains("submitted"), "{}", o.stderr);
    o.success()
        .stderr_has("trial 1 finished earlier, skipped")
        .stderr_has("trial 2 is still in Slurm's queue");
    sweep(&["--resume", r, "--launcher", "local"])
        .code(2)
        .stderr_has("was submitted to Slurm");

    // Out of the queue and failed: only trial 2 goes back.
    std::fs::remove_file(bin.join("queue.txt")).unwrap();
    sweep(&["--resume", r])
        .code(1)
        .stderr_has("submitted 1 trial(s) (2)")
        .stderr_has("trial 2 failed (exit 2)");
    let arrays = std::fs::read_to_string(bin.join("arrays.txt")).unwrap();
    assert_eq!(arrays, "0-2\n2\n");

    // Slurm options without Slurm, and no Slurm client at all.
    let empty = format!("{}", dir.join("no-bin").display());
    let mut cmd = kiln();
    cmd.args([
        "sweep",
        "--config",
        f,
        "--output",
        outs,
        "--partition",
        "gpu",
    ]);
    Output::of(cmd.env("PATH", &empty))
        .code(2)
        .stderr_has("--partition is a Slurm option: add --launcher slurm");
    let mut cmd = kiln();
    cmd.args([
        "sweep",
        "--config",
        f,
        "--output",
        outs,
        "--launcher",
        "slurm",
    ]);
    Output::of(cmd.env("PATH", &empty))
        .code(2)
        .stderr_has("cannot run squeue")
        .stderr_has("Slurm's client");
}

#[test]
fn warmup_on_the_cpu_says_there_is_nothing_to_compile() {
    Output::of(kiln().args(["warmup", "--config", DEBUG_TOML]))
        .success()
        .stderr_has("nothing to warm up");
    Output::of(kiln().args(["warmup", "--config", DEBUG_TOML, "--set", "train.epochs=0"]))
        .code(2)
        .stderr_has("train.epochs");
}

#[test]
fn gradient_checkpointing_trains_to_the_same_result() {
    let plain = tempdir("recompute-plain");
    train(&plain, &[]).success();
    let recompute = tempdir("recompute-on");
    train(&recompute, &["kernels.gradient_checkpointing=true"]).success();
    let (a, b) = (summary(&run_dir(&plain)), summary(&run_dir(&recompute)));
    let loss = |s: &serde_json::Value| s["final_test_loss"].as_f64().unwrap();
    assert!(
        (loss(&a) - loss(&b)).abs() < 1e-4,
        "{} vs {}",
        loss(&a),
        loss(&b)
    );
    assert_eq!(a["final_test_acc"], b["final_test_acc"]);
}

#[test]
fn bench_reports_throughput_as_json_and_as_text() {
    let args = [
        "bench",
        "--model",
        "resnet18",
        "--image-size",
        "8",
        "--batch",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--breakdown-steps",
        "1",
    ];
    let out = Output::of(kiln().args(args).arg("--json"));
    out.success();
    let doc: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    assert_eq!(doc["model"], "resnet18");
    assert_eq!(doc["devices"], 1);
    assert!(doc["img_per_s"].as_f64().unwrap() > 0.0);
    assert!(doc["breakdown"]["backward_ms"].as_f64().unwrap() > 0.0);
    // kiln's own waits are CUDA's: the CPU backend makes no round trips.
    assert_eq!(doc["waits"]["round_trips"].as_f64(), Some(0.0));
    assert_eq!(doc["precision"], "fp32");
    // Page-locked uploads are the default, a CUDA path that the CPU has no use for.
    assert_eq!(doc["pin_memory"], true);
    let pageable = Output::of(
        kiln()
            .args(args)
            .args(["--json", "--set", "data.pin_memory=false"]),
    );
    let doc: serde_json::Value = serde_json::from_str(pageable.stdout.trim()).unwrap();
    pageable.success();
    assert_eq!(doc["pin_memory"], false);
    Output::of(kiln().args(args).args(["--precision", "fp16"]))
        .success()
        .stdout_has("throughput")
        .stdout_has("synced phases")
        .stdout_has("fp16");
    // Channels-last runs on the CPU (through NCHW views of Burn's kernels).
    let nhwc = Output::of(kiln().args(args).args(["--json", "--channels-last"]));
    nhwc.success();
    let doc: serde_json::Value = serde_json::from_str(nhwc.stdout.trim()).unwrap();
    assert_eq!(doc["channels_last"], true);
    assert!(doc["img_per_s"].as_f64().unwrap() > 0.0);
}

/// Every epoch's train loss and the final test loss, as written (f64 in summary.json).
fn losses(run: &Path) -> (Vec<String>, serde_json::Value) {
    let train = metrics(run).into_iter().map(|r| r[3].clone()).collect();
    (train, summary(run)["final_test_loss"].clone())
}

#[test]
fn deterministic_cpu_runs_repeat_exactly() {
    // (model.bin itself differs between runs: Burn stores random parameter ids in it.)
    let sets = ["train.deterministic=true", "devices.backend=cpu"];
    let (a, b) = (tempdir("det-a"), tempdir("det-b"));
    train(&a, &sets).success();
    train(&b, &sets).success();
    assert_eq!(losses(&run_dir(&a)), losses(&run_dir(&b)));
}

#[test]
fn mixed_precision_trains_close_to_fp32() {
    let fp32 = tempdir("prec-fp32");
    train(&fp32, &[]).success();
    let a = summary(&run_dir(&fp32));
    let loss = |s: &serde_json::Value| s["final_test_loss"].as_f64().unwrap();
    for precision in ["bf16", "fp16"] {
        let low = tempdir(&format!("prec-{precision}"));
        train(&low, &[&format!("train.precision={precision}")]).success();
        let b = summary(&run_dir(&low));
        // Same data, same initial weights; the low precision rounds every convolution's
        // inputs.
        assert!(
            (loss(&a) - loss(&b)).abs() < 0.1 * loss(&a),
            "{precision}: {} vs {}",
            loss(&a),
            loss(&b)
        );
        assert_ne!(losses(&run_dir(&fp32)), losses(&run_dir(&low)));
        // Only fp16 scales the loss; a small model does not overflow at 65536.
        match precision {
            "fp16" => {
                assert_eq!(b["loss_scale"], 65536.0, "{b}");
                assert_eq!(b["skipped_steps"], 0, "{b}");
            }
            _ => assert!(b.get("loss_scale").is_none(), "{b}"),
        }
    }
}

#[test]
fn an_fp32_run_resumed_in_fp16_starts_its_loss_scale() {
    let out = tempdir("resume-fp16");
    train(&out, &["train.epochs=2", "train.max_steps=5"]).success();
    let run = run_dir(&out);
    Output::of(
        kiln()
            .args(["train", "--config", DEBUG_TOML, "--set", "train.epochs=2"])
            .args(["--set", "train.precision=fp16", "--resume"])
            .arg(&run),
    )
    .success()
    .stderr_has("resuming with train.precision changed");
    assert_eq!(summary(&run)["loss_scale"], 65536.0);
}

fn launch(out: &Path, how: &[&str], sets: &[&str]) -> Command {
    let mut cmd = kiln();
    cmd.arg("launch")
        .args(how)
        .args(["--config", DEBUG_TOML, "--output"])
        .arg(out);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd
}

#[test]
fn launch_on_the_cpu_asks_how_many_processes() {
    let out = tempdir("launch-nproc");
    Output::of(&mut launch(&out, &[], &[]))
        .code(2)
        .stderr_has("--nproc");
}

#[test]
fn two_launched_processes_restart_together_after_one_fails_and_end_as_if_uninterrupted() {
    let plain = tempdir("launch-plain");
    Output::of(&mut launch(
        &plain,
        &["--nproc", "2"],
        &["checkpoint.every_steps=4"],
    ))
    .success()
    .stderr_has("2 processes joined")
    .stderr_has("rank 1: kiln: process: rank 1 of 2");
    let s = summary(&run_dir(&plain));
    assert_eq!(s["devices"].as_array().map(Vec::len), Some(2), "{s}");
    // Rank 1's device fails in step 10 (epoch 2); the epoch-1 checkpoint is step 8.
    let failed = tempdir("launch-error");
    let sets = [
        "checkpoint.every_steps=4",
        "faults.inject=error",
        "faults.device=1",
        "faults.step=10",
    ];
    Output::of(&mut launch(&failed, &["--nproc", "2"], &sets))
        .success()
        .stderr_has("rank 1 (cpu) failed at step 10")
        .stderr_has("rank 1: kiln: error: replica on rank 1 (cpu) failed at step 10")
        .stderr_has("left the run during step 10")
        .stderr_has("restart 1 of 3")
        .stderr_has("step-000000008");
    assert_eq!(
        summary(&run_dir(&plain))["final_test_loss"],
        summary(&run_dir(&failed))["final_test_loss"]
    );
}

#[test]
fn a_launched_process_killed_with_sigkill_is_restarted_with_the_others() {
    let plain = tempdir("launch-kill-plain");
    Output::of(&mut launch(
        &plain,
        &["--nproc", "2"],
        &["checkpoint.every_steps=2"],
    ))
    .success();
    // Rank 1 is held inside step 7 (an injected hang, watched only after 10 minutes),
    // so rank 0 waits for it; then rank 1 is killed.
    let out = tempdir("launch-kill");
    let sets = [
        "checkpoint.every_steps=2",
        "faults.inject=hang",
        "faults.device=1",
        "faults.step=7",
        "watchdog.hang_timeout_s=600",
    ];
    let mut child = launch(&out, &["--nproc", "2"], &sets)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
        s
    });
    let run = wait_for_checkpoint(&out, 6);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let ranks: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("ranks.json")).unwrap()).unwrap();
    let pid = ranks[1]["pid"].as_u64().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-9", &pid])
            .status()
            .unwrap()
            .success()
    );
    let code = child.wait().unwrap().code();
    let stderr = reader.join().unwrap();
    assert_eq!(code, Some(0), "{stderr}");
    for text in [
        "rank 1 (cpu) was killed",
        "left the run during step 7",
        "restart 1 of 3",
        "step-000000006",
    ] {
        assert!(stderr.contains(text), "stderr lacks {text:?}:\n{stderr}");
    }
    assert_eq!(
        summary(&run_dir(&plain))["final_test_loss"],
        summary(&run)["final_test_loss"]
    );
}

/// A stand-in for `srun` in `dir/bin`: runs the command as `FAKE_SRUN_TASKS` tasks of
/// one step on this machine, with the variables Slurm gives each task, and exits with
/// the highest exit code, as srun does.
fn fake_srun(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let srun = r#"#!/bin/sh
[ "$1" = "--kill-on-bad-exit=1" ] || { echo "fake srun: expected --kill-on-bad-exit=1" >&2; exit 99; }
shift
n=$FAKE_SRUN_TASKS
steps="$(dirname "$0")/steps"
step=$(cat "$steps" 2> /dev/null || echo 0)
echo $((step + 1)) > "$steps"
pids=""
i=0
while [ $i -lt $n ]; do
  SLURM_STEP_NUM_TASKS=$n SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 \
  SLURM_STEP_TASKS_PER_NODE=$n SLURM_STEP_NODELIST=localhost SLURM_JOB_ID=$FAKE_SRUN_JOB \
  SLURM_STEP_ID=$step "$@" &
  pids="$pids $!"
  i=$((i + 1))
done
code=0
for p in $pids; do
  wait $p
  c=$?
  [ $c -gt $code ] && code=$c
done
exit $code
"#;
    let path = bin.join("srun");
    std::fs::write(&path, srun).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

#[test]
fn srun_tasks_find_their_ranks_in_slurms_variables_and_a_failed_step_is_run_again() {
    let dir = tempdir("launch-srun");
    let bin = fake_srun(&dir);
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let local = tempdir("launch-srun-local");
    Output::of(&mut launch(
        &local,
        &["--nproc", "2"],
        &["checkpoint.every_steps=4"],
    ))
    .success();
    let out = dir.join("runs");
    let sets = [
        "checkpoint.every_steps=4",
        "faults.inject=error",
        "faults.device=1",
        "faults.step=10",
    ];
    Output::of(
        launch(&out, &["--srun"], &sets)
            .env("PATH", path)
            .env("FAKE_SRUN_TASKS", "2")
            .env("FAKE_SRUN_JOB", (std::process::id() % 10_000).to_string()),
    )
    .success()
    .stderr_has("rank 1 of 2 (local rank 1 of 2), started by Slurm (srun), rank 0 at localhost:")
    .stderr_has("rank 1 (cpu) failed at step 10")
    .stderr_has("restart 1 of 3")
    .stderr_has("step-000000008");
    assert_eq!(
        std::fs::read_to_string(bin.join("steps")).unwrap().trim(),
        "2"
    );
    assert_eq!(
        summary(&run_dir(&local))["final_test_loss"],
        summary(&run_dir(&out))["final_test_loss"]
    );
}

#[test]
fn early_stopping_ends_a_run_that_stopped_improving_and_says_why() {
    // With a min_delta of 0.99 no epoch can improve on the first.
    let out = tempdir("early-stop");
    train(
        &out,
        &[
            "train.epochs=6",
            "train.early_stop_patience=2",
            "train.early_stop_min_delta=0.99",
        ],
    )
    .success()
    .stderr_has("early stop: test accuracy not above")
    .stderr_has("stopped early after 3 epochs");
    let run = run_dir(&out);
    let s = summary(&run);
    assert_eq!(s["status"], "finished", "{s}");
    assert_eq!(s["epochs_completed"], 3, "{s}");
    assert!(
        s["ended"].as_str().unwrap().starts_with("early stop"),
        "{s}"
    );
    assert_eq!(metrics(&run).len(), 3);
    // Resumed, it stops at once: the rule reads the history the checkpoint keeps.
    Output::of(kiln().args(["train", "--resume"]).arg(&run))
        .success()
        .stderr_has("stopped early after 3 epochs");
    assert_eq!(summary(&run)["epochs_completed"], 3);
    // Without it the same run goes on to its last epoch.
    let all = tempdir("early-stop-off");
    train(&all, &["train.epochs=6"]).success();
    let s = summary(&run_dir(&all));
    assert_eq!(
        (s["epochs_completed"].as_u64(), s["ended"].as_str()),
        (Some(6), Some("train.epochs reached"))
    );
}

#[test]
fn a_dry_run_prints_the_resolved_config_and_makes_nothing() {
    let out = tempdir("dry-run").join("runs");
    let o = Output::of(
        kiln()
            .args(["train", "--config", DEBUG_TOML, "--dry-run", "--output"])
            .arg(&out)
            .args(["--set", "train.epochs=7"]),
    );
    o.success()
        .stderr_has("kiln: devices: cpu")
        .stderr_has("256 train / 64 test images")
        .stderr_has("nothing trained");
    let printed: toml::Value = toml::from_str(&o.stdout).expect("stdout is the config as TOML");
    assert_eq!(printed["train"]["epochs"].as_integer(), Some(7));
    assert!(!out.exists(), "a dry run makes no run dir");
    // What training would refuse, the dry run refuses the same way.
    Output::of(
        kiln()
            .args(["train", "--config", DEBUG_TOML, "--dry-run", "--output"])
            .arg(&out)
            .args(["--set", "train.batch_size=0"]),
    )
    .code(2)
    .stderr_has("train.batch_size = 0");
}

#[test]
fn completion_scripts_cover_every_subcommand_and_flag() {
    for shell in ["bash", "zsh", "fish"] {
        let o = Output::of(kiln().args(["completions", shell]));
        o.success();
        for word in ["train", "launch", "sweep", "dry-run", "max-restarts"] {
            assert!(o.stdout.contains(word), "{shell} lacks {word}");
        }
    }
    Output::of(kiln().args(["completions", "tcsh"]))
        .code(2)
        .stderr_has("possible values");
}
