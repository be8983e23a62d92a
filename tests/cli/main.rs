//! The one CLI test binary: runs the real `kiln` executable on the CPU, on fixtures
//! the tests make themselves.

use std::path::{Path, PathBuf};
use std::process::Command;

use assert_cmd::prelude::*;
use predicates::prelude::*;
use predicates::str::contains;

const DEBUG_TOML: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/debug.toml");

fn kiln() -> Command {
    let mut cmd = Command::cargo_bin("kiln").expect("the kiln binary is built for tests");
    // No GPU for tests, whatever the machine has.
    cmd.env("CUDA_VISIBLE_DEVICES", "");
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
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

fn train(out: &Path, sets: &[&str]) -> assert_cmd::assert::Assert {
    let mut cmd = kiln();
    cmd.args(["train", "--config", DEBUG_TOML, "--output"])
        .arg(out);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.assert()
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
    kiln()
        .arg("--help")
        .assert()
        .success()
        .stdout(contains("train"));
    kiln()
        .args(["train", "--help"])
        .assert()
        .success()
        .stdout(contains("--resume"));
    kiln()
        .arg("--version")
        .assert()
        .success()
        .stdout(contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn unknown_set_key_is_a_usage_error_naming_key_and_suggestion() {
    let out = tempfile::tempdir().unwrap();
    train(out.path(), &["train.batch_szie=32"])
        .code(2)
        .stderr(contains("train.batch_szie").and(contains("did you mean `train.batch_size`")));
}

#[test]
fn bad_value_is_a_usage_error_naming_the_value() {
    let out = tempfile::tempdir().unwrap();
    train(out.path(), &["optim.lr=-1"])
        .code(2)
        .stderr(contains("optim.lr = -1"));
    train(out.path(), &["train.epochs=many"])
        .code(2)
        .stderr(contains("train.epochs = \"many\""));
}

#[test]
fn missing_config_file_and_missing_data_are_usage_errors() {
    kiln()
        .args(["train", "--config", "no/such.toml"])
        .assert()
        .code(2)
        .stderr(contains("no/such.toml"));
    let out = tempfile::tempdir().unwrap();
    train(
        out.path(),
        &[
            "data.dataset=fashion_mnist",
            "data.root=/nonexistent/fmnist",
        ],
    )
    .code(2)
    .stderr(contains("/nonexistent/fmnist"));
}

#[test]
fn training_writes_a_complete_run_dir_and_the_loss_falls() {
    let out = tempfile::tempdir().unwrap();
    train(out.path(), &["train.epochs=4"])
        .success()
        .stderr(contains("training on the CPU").and(contains("finished 4 epochs")));
    let run = run_dir(out.path());
    for f in [
        "config.toml",
        "metrics.csv",
        "summary.json",
        "curves.png",
        "checkpoints/latest",
    ] {
        assert!(run.join(f).is_file(), "{f} missing");
    }
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

    kiln()
        .args(["eval", "--run"])
        .arg(&run)
        .assert()
        .success()
        .stdout(contains("test split").and(contains("64 images")));
}

#[test]
fn a_run_stopped_mid_epoch_resumes_where_it_stopped() {
    // Steps per epoch: 256 / 32 = 8. Stop mid-epoch 2 (step 11), resume to the end.
    // (That the result is bitwise the uninterrupted run is tested in train::trainer.)
    let parts = tempfile::tempdir().unwrap();
    train(parts.path(), &["train.epochs=2", "train.max_steps=11"])
        .success()
        .stderr(contains("stopped at step 11"));
    let run = run_dir(parts.path());
    kiln()
        .args([
            "train",
            "--config",
            DEBUG_TOML,
            "--set",
            "train.epochs=2",
            "--resume",
        ])
        .arg(&run)
        .assert()
        .success()
        .stderr(
            contains("resuming from")
                .and(contains("step 11"))
                .and(contains("finished 2 epochs")),
        );
    assert_eq!(metrics(&run).len(), 2);
    assert!(run.join("checkpoints/step-000000016/model.bin").is_file());
}

#[test]
fn resume_refuses_a_different_model_and_names_the_key() {
    let out = tempfile::tempdir().unwrap();
    train(out.path(), &["train.epochs=1"]).success();
    let run = run_dir(out.path());
    kiln()
        .args([
            "train",
            "--config",
            DEBUG_TOML,
            "--set",
            "model.arch=resnet20",
            "--resume",
        ])
        .arg(&run)
        .assert()
        .code(2)
        .stderr(contains("model.arch"));
}

#[test]
fn corrupt_latest_checkpoint_is_skipped_for_the_previous_one() {
    let out = tempfile::tempdir().unwrap();
    train(out.path(), &["train.epochs=2"]).success();
    let run = run_dir(out.path());
    let latest = run.join("checkpoints/step-000000016/model.bin");
    let bytes = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, &bytes[..bytes.len() / 2]).unwrap();
    kiln()
        .args(["train", "--set", "train.epochs=3", "--resume"])
        .arg(&run)
        .assert()
        .success()
        .stderr(
            contains("skipping")
                .and(contains("step-000000016"))
                .and(contains("resuming from")),
        );
}

#[test]
fn resume_without_checkpoints_is_a_usage_error() {
    let out = tempfile::tempdir().unwrap();
    kiln()
        .args(["train", "--config", DEBUG_TOML, "--output"])
        .arg(out.path())
        .arg("--resume")
        .assert()
        .code(2)
        .stderr(contains("no run of"));
}

#[test]
fn cuda_backend_without_a_gpu_is_reported_not_a_panic() {
    let out = tempfile::tempdir().unwrap();
    train(out.path(), &["devices.backend=cuda"])
        .code(75)
        .stderr(contains("no GPU can be used").and(contains("panicked").not()));
    train(
        out.path(),
        &["devices.backend=auto", "devices.require_gpu=true"],
    )
    .code(75)
    .stderr(contains("devices.require_gpu"));
}

#[test]
fn devices_command_reports_without_a_gpu() {
    kiln()
        .arg("devices")
        .assert()
        .success()
        .stdout(contains("training runs on the CPU"));
    kiln()
        .args(["devices", "--json"])
        .assert()
        .success()
        .stdout(contains("\"gpus\""));
}

#[test]
fn image_folder_dataset_trains() {
    let data = tempfile::tempdir().unwrap();
    for split in ["train", "test"] {
        for (c, class) in ["red", "blue"].iter().enumerate() {
            let dir = data.path().join(split).join(class);
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
    let out = tempfile::tempdir().unwrap();
    let root = format!("data.root={}", data.path().display());
    train(
        out.path(),
        &[
            "data.dataset=image_folder",
            &root,
            "train.batch_size=4",
            "train.epochs=2",
            "data.image_size=8",
        ],
    )
    .success()
    .stderr(contains("16 train / 16 test images, 3x8x8, 2 classes"));
}
