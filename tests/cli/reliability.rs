//! Nothing outside a run can end it or mix it up: closed pipes, signals to the
//! supervisor, a second process on the same run dir, a lost `latest` pointer, damaged
//! checkpoints, failures that cannot pass, bad images, absurd sizes; and a table of
//! bad inputs that must each end in one clear error, never a panic.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use super::{
    DEBUG_TOML, Output, kiln, metrics, run_dir, summary, tempdir, train, wait_for_checkpoint,
};

/// `kiln train` of the debug config into `out`, started and left running.
fn start(out: &Path, extra: &[&str], sets: &[&str]) -> Child {
    let mut cmd = kiln();
    cmd.args(["train", "--config", DEBUG_TOML, "--output"])
        .arg(out);
    cmd.args(extra);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the kiln binary should start")
}

/// Waits (at most `secs`) for `child` to end; its exit code, `None` for a signal.
fn wait_for(child: &mut Child, secs: u64) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kiln did not end within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// The pids of the processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    // "pid (comm) state ppid ...": the fields after the last ')'.
                    let rest = &s[s.rfind(')')? + 2..];
                    rest.split(' ').nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// Whether process `pid` still runs (a zombie waiting to be reaped does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s[s.rfind(')')? + 2..].chars().next())
        .is_some_and(|state| state != 'Z' && state != 'X')
}

#[test]
fn a_closed_pipe_never_ends_a_run_and_its_log_keeps_everything() {
    let out = tempdir("pipe");
    // `kiln train ... 2>&1 | head -3`: the reader goes away after three lines.
    let mut child = kiln()
        .args(["train", "--config", DEBUG_TOML, "--output"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    for _ in 0..3 {
        lines.next().unwrap().unwrap();
    }
    drop(lines);
    assert_eq!(wait_for(&mut child, 120), Some(0));
    let run = run_dir(&out);
    assert_eq!(summary(&run)["status"], "finished");
    let log = std::fs::read_to_string(run.join("train.log")).unwrap();
    for line in [
        "kiln: data: Synthetic",
        "epoch 3/3:",
        "kiln: finished 3 epochs",
    ] {
        assert!(log.contains(line), "train.log lacks {line:?}:\n{log}");
    }
    // `kiln devices --json | head -c 10`.
    let mut child = kiln()
        .args(["devices", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 10];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(wait_for(&mut child, 60), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_second_process_on_a_run_dir_is_refused_naming_the_first_which_a_dead_one_is_not() {
    let out = tempdir("lock");
    // Held inside step 7 (a hang the watchdog would notice after 10 minutes).
    let sets = [
        "checkpoint.every_steps=2",
        "faults.inject=hang",
        "faults.step=7",
        "watchdog.hang_timeout_s=600",
    ];
    let mut first = start(&out, &[], &sets);
    let run = wait_for_checkpoint(&out, 6);
    let second = Output::of(kiln().args(["train", "--resume"]).arg(&run));
    second
        .code(2)
        .stderr_has("is in use by another kiln process")
        .stderr_has(&format!("pid {}", first.id()))
        .stderr_has("since ");
    let sweep = Output::of(
        kiln()
            .args(["train", "--no-supervisor", "--resume"])
            .arg(&run),
    );
    sweep.code(2).stderr_has("in use");
    // The first one killed with SIGKILL (supervisor and child): the lock goes with it.
    let children = children_of(first.id());
    first.kill().unwrap();
    first.wait().unwrap();
    for c in children {
        let deadline = Instant::now() + Duration::from_secs(10);
        while alive(c) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!alive(c), "the training child {c} outlived its supervisor");
    }
    Output::of(kiln().args(["train", "--resume"]).arg(&run))
        .success()
        .stderr_has("was held by a kiln process that is gone")
        .stderr_has("step-000000006");
    // A clean end leaves nothing for the next owner to report.
    let lock = std::fs::read_to_string(run.join("kiln.lock")).unwrap();
    assert_eq!(lock, "", "the lock file after a clean end");
}

#[test]
fn a_run_without_its_latest_pointer_resumes_from_its_newest_checkpoint() {
    let plain = tempdir("latest-plain");
    train(&plain, &["checkpoint.every_steps=2"]).success();
    let out = tempdir("latest");
    train(&out, &["checkpoint.every_steps=2", "train.max_steps=10"]).success();
    let run = run_dir(&out);
    std::fs::remove_file(run.join("checkpoints/latest")).unwrap();
    // Named, and found as the newest run of the config.
    Output::of(
        kiln()
            .args(["train", "--config", DEBUG_TOML, "--resume", "--output"])
            .arg(&out),
    )
    .success()
    .stderr_has("resuming from")
    .stderr_has("step-000000010");
    assert_eq!(
        summary(&run_dir(&plain))["final_test_loss"],
        summary(&run)["final_test_loss"]
    );
}

#[test]
fn sigterm_to_the_supervisor_checkpoints_the_run_and_sigkill_leaves_no_orphan() {
    let out = tempdir("sigterm");
    let sets = ["train.epochs=400", "checkpoint.every_steps=2"];
    let mut sup = start(&out, &[], &sets);
    let run = wait_for_checkpoint(&out, 4);
    signal(sup.id(), "-TERM");
    assert_eq!(wait_for(&mut sup, 120), Some(130));
    let s = summary(&run);
    assert_eq!(s["status"], "interrupted", "{s}");
    let resumed = Output::of(
        kiln()
            .args(["train", "--set", "train.max_steps=30", "--resume"])
            .arg(&run),
    );
    resumed.success().stderr_has("resuming from");

    let out = tempdir("sigkill");
    let mut sup = start(&out, &[], &sets);
    let run = wait_for_checkpoint(&out, 4);
    let children = children_of(sup.id());
    assert_eq!(
        children.len(),
        1,
        "the supervisor runs one training process"
    );
    signal(sup.id(), "-KILL");
    sup.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(children[0]) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !alive(children[0]),
        "the training child outlived its supervisor"
    );
    let latest = |r: &Path| std::fs::read_dir(r.join("checkpoints")).unwrap().count();
    let before = latest(&run);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(latest(&run), before, "nothing trains on after the kill");
}

#[test]
fn a_failure_that_cannot_pass_is_not_retried_and_leaves_no_empty_run() {
    let out = tempdir("no-gpu");
    train(&out, &["devices.backend=cuda"])
        .code(75)
        .stderr_has("no GPU can be used")
        .stderr_lacks("restart");
    train(
        &out,
        &[
            "data.dataset=fashion_mnist",
            "data.root=/nonexistent/fmnist",
        ],
    )
    .code(2)
    .stderr_lacks("restart");
    let left: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        left.iter().all(|p| p.join("checkpoints").exists()),
        "runs that never trained were left: {left:?}"
    );
}

fn image_folder(name: &str) -> PathBuf {
    let data = tempdir(name);
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
    data
}

#[test]
fn a_bad_test_image_stops_the_run_before_training_naming_the_file() {
    let data = image_folder("bad-image-data");
    std::fs::write(data.join("test/blue/5.png"), b"not a png at all").unwrap();
    let out = tempdir("bad-image");
    let root = format!("data.root={}", data.display());
    let sets = [
        "data.dataset=image_folder",
        root.as_str(),
        "train.batch_size=4",
        "train.epochs=1",
        "data.image_size=8",
    ];
    train(&out, &sets)
        .code(2)
        .stderr_has("test/blue/5.png")
        .stderr_has("cannot decode")
        .stderr_lacks("epoch 1/1");
    image::RgbImage::from_pixel(10, 10, image::Rgb([1, 2, 3]))
        .save(data.join("test/blue/5.png"))
        .unwrap();
    train(&out, &sets)
        .success()
        // The other 31 images were checked by the first run and are not read again.
        .stderr_has("checked 1 images");
}

#[test]
fn a_resumed_epochs_row_covers_the_whole_epoch() {
    let whole = tempdir("epoch-whole");
    train(&whole, &["train.epochs=2"]).success();
    let parts = tempdir("epoch-parts");
    // 8 steps per epoch: a stop inside epoch 2, then the rest.
    train(&parts, &["train.epochs=2", "train.max_steps=11"]).success();
    let run = run_dir(&parts);
    Output::of(
        kiln()
            .args(["train", "--set", "train.max_steps=0", "--resume"])
            .arg(&run),
    )
    .success();
    let (a, b) = (metrics(&run_dir(&whole)), metrics(&run));
    assert_eq!(a.len(), 2);
    assert_eq!(b.len(), 2);
    // Accuracy counts images exactly; the loss is summed in another order.
    assert_eq!(a[1][4], b[1][4], "train_acc of epoch 2");
    let (la, lb): (f64, f64) = (a[1][3].parse().unwrap(), b[1][3].parse().unwrap());
    assert!((la - lb).abs() < 1e-5 * la.abs(), "train_loss {la} vs {lb}");
}

#[test]
fn damaged_checkpoints_are_skipped_with_a_warning_for_the_previous_good_one() {
    use sha2::{Digest, Sha256};
    let out = tempdir("damaged");
    train(
        &out,
        &[
            "checkpoint.every_steps=2",
            "train.max_steps=10",
            "checkpoint.keep_last=5",
        ],
    )
    .success();
    let run = run_dir(&out);
    let ckpt = |s: u64| run.join(format!("checkpoints/step-{s:09}"));
    // Step 10: its manifest deleted. Step 8: its model truncated, the manifest made to
    // match, so only reading it shows the damage.
    std::fs::remove_file(ckpt(10).join("manifest.json")).unwrap();
    let model = ckpt(8).join("model.bin");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let manifest = ckpt(8).join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        if f["name"] == "model.bin" {
            let cut = &bytes[..bytes.len() / 2];
            f["bytes"] = cut.len().into();
            f["sha256"] = Sha256::digest(cut)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into();
        }
    }
    std::fs::write(&manifest, serde_json::to_string(&m).unwrap()).unwrap();
    Output::of(
        kiln()
            .args(["train", "--no-supervisor", "--resume"])
            .arg(&run),
    )
    .success()
    .stderr_has("warning: skipping")
    .stderr_has("step-000000010")
    .stderr_has("incomplete or damaged")
    .stderr_has("step-000000008")
    .stderr_has("resuming from")
    .stderr_has("step-000000006");
}

#[test]
fn a_plot_that_cannot_be_drawn_is_a_warning_and_the_summary_tells_the_truth() {
    let out = tempdir("plot");
    train(&out, &["train.epochs=1"]).success();
    let run = run_dir(&out);
    std::fs::remove_file(run.join("curves.png")).unwrap();
    std::fs::create_dir(run.join("curves.png")).unwrap();
    Output::of(
        kiln()
            .args(["train", "--set", "train.epochs=2", "--resume"])
            .arg(&run),
    )
    .success()
    .stderr_has("warning: cannot draw");
    assert_eq!(summary(&run)["status"], "finished");
    assert!(!run.join("curves.tmp.png").exists());
}

/// A sweep file of `axes` over the debug config, in `dir`.
fn sweep_file(dir: &Path, body: &str) -> PathBuf {
    let file = dir.join("sweep.toml");
    std::fs::write(
        &file,
        format!("base = \"{DEBUG_TOML}\"\nmetric = \"best_test_acc\"\ngoal = \"max\"\n{body}"),
    )
    .unwrap();
    file
}

/// Every bad input a careful user tried ends with one clear message naming what to
/// fix, the right exit code, and never a panic or a backtrace.
#[test]
fn bad_inputs_end_in_clear_errors_never_a_panic() {
    let out = tempdir("bad-inputs");
    let dir = tempdir("bad-inputs-files");
    let garbage = dir.join("garbage.toml");
    std::fs::write(&garbage, "[train\nepochs = 3").unwrap();
    let binary = dir.join("binary.toml");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x01]).unwrap();
    let not_run = tempdir("bad-inputs-not-a-run");
    let big_sweep = sweep_file(
        &dir,
        "[random]\ntrials = 100000000000\nseed = 0\naxes = { \"optim.lr\" = { uniform = [0.01, 0.1] } }\n",
    );
    let no_axes_dir = tempdir("bad-inputs-no-axes");
    let no_axes = sweep_file(&no_axes_dir, "");
    let devices_axis_dir = tempdir("bad-inputs-devices-axis");
    let devices_axis = sweep_file(&devices_axis_dir, "[grid]\n\"devices.count\" = [1, 2]\n");
    let s = |v: &str| v.to_string();
    let p = |v: &Path| v.display().to_string();
    let o = p(&out);
    // (arguments, exit code, what the message must name)
    let train = |sets: &[&str]| -> Vec<String> {
        let mut a = vec![
            s("train"),
            s("--config"),
            s(DEBUG_TOML),
            s("--output"),
            o.clone(),
        ];
        for x in sets {
            a.push(s("--set"));
            a.push(s(x));
        }
        a
    };
    let mut cases: Vec<(Vec<String>, i32, &str)> = vec![
        (train(&["train.epochs=0"]), 2, "train.epochs = 0"),
        (train(&["train.epochs=-3"]), 2, "train.epochs"),
        (train(&["train.epochs=1e12"]), 2, "train.epochs"),
        (train(&["train.epochs=4000000000"]), 2, "at most 100000"),
        (train(&["train.batch_size=0"]), 2, "train.batch_size = 0"),
        (train(&["train.batch_size=100000000"]), 2, "at most 1048576"),
        (
            train(&["train.batch_size=10000"]),
            2,
            "larger than the training set",
        ),
        (
            train(&["train.grad_accum_steps=0"]),
            2,
            "train.grad_accum_steps = 0",
        ),
        (
            train(&["train.grad_accum_steps=7"]),
            2,
            "a divisor of train.batch_size",
        ),
        (
            train(&["train.label_smoothing=1.5"]),
            2,
            "train.label_smoothing = 1.5",
        ),
        (
            train(&["train.grad_clip_norm=-1"]),
            2,
            "train.grad_clip_norm = -1",
        ),
        (
            train(&["train.log_every_steps=0"]),
            2,
            "train.log_every_steps = 0",
        ),
        (train(&["train.precision=fp8"]), 2, "train.precision"),
        (train(&["train.seed=-1"]), 2, "train.seed"),
        (train(&["train.max_steps=ten"]), 2, "train.max_steps"),
        (
            train(&["train.autotune=fast"]),
            2,
            "write `kernels.autotune` instead",
        ),
        (
            train(&["train.strategy=dp"]),
            2,
            "write `parallel.strategy` instead",
        ),
        (
            train(&["train.hang_timeout_s=5"]),
            2,
            "write `watchdog.hang_timeout_s` instead",
        ),
        (
            train(&["train.eval_every_epochs=2"]),
            2,
            "write `eval.every_epochs` instead",
        ),
        (
            train(&["data.prefetch=1000000000000"]),
            2,
            "data.prefetch = 1000000000000",
        ),
        (train(&["data.prefetch=0"]), 2, "data.prefetch = 0"),
        (train(&["data.num_workers=100000000"]), 2, "at most 256"),
        (train(&["data.num_workers=0"]), 2, "data.num_workers = 0"),
        (
            train(&["data.synthetic_train_size=1000000000000"]),
            2,
            "at most 10000000",
        ),
        (
            train(&["data.synthetic_train_size=0"]),
            2,
            "data.synthetic_train_size",
        ),
        (
            train(&["data.synthetic_classes=1"]),
            2,
            "data.synthetic_classes = 1",
        ),
        (
            train(&["data.synthetic_channels=9"]),
            2,
            "data.synthetic_channels = 9",
        ),
        (
            train(&["data.image_size=100000"]),
            2,
            "data.image_size = 100000",
        ),
        (
            train(&["data.crop_padding=5000"]),
            2,
            "data.crop_padding = 5000",
        ),
        (train(&["data.dataset=imagenet"]), 2, "data.dataset"),
        (
            train(&["data.dataset=cifar10", "data.root=/nonexistent/cifar"]),
            2,
            "/nonexistent/cifar",
        ),
        (
            train(&["data.dataset=image_folder", "data.root=/nonexistent/images"]),
            2,
            "/nonexistent/images",
        ),
        (train(&["data.hflip=sometimes"]), 2, "data.hflip"),
        (train(&["model.arch=resnet19"]), 2, "resnet18"),
        (train(&["model.stem=huge"]), 2, "model.stem"),
        (train(&["optim.lr=0"]), 2, "optim.lr = 0"),
        (train(&["optim.lr=inf"]), 2, "optim.lr = inf"),
        (train(&["optim.momentum=1"]), 2, "optim.momentum = 1"),
        (
            train(&["optim.momentum=0", "optim.nesterov=true"]),
            2,
            "optim.nesterov",
        ),
        (
            train(&["optim.weight_decay=-0.1"]),
            2,
            "optim.weight_decay = -0.1",
        ),
        (
            train(&["optim.warmup_epochs=50"]),
            2,
            "optim.warmup_epochs = 50",
        ),
        (train(&["optim.min_lr=5"]), 2, "optim.min_lr = 5"),
        (train(&["optim.schedule=step"]), 2, "optim.step_milestones"),
        (
            train(&["optim.schedule=step", "optim.step_milestones=[3, 1]"]),
            2,
            "increasing order",
        ),
        (
            train(&["optim.onecycle_pct_start=1.5"]),
            2,
            "optim.onecycle_pct_start = 1.5",
        ),
        (train(&["optim.name=lion"]), 2, "optim.name"),
        (
            train(&["parallel.bucket_mib=100000"]),
            2,
            "parallel.bucket_mib = 100000",
        ),
        (
            train(&["parallel.device_weights=[1, -1]"]),
            2,
            "parallel.device_weights",
        ),
        (
            train(&["parallel.sync_batchnorm=true"]),
            2,
            "parallel.sync_batchnorm = true",
        ),
        (
            train(&["parallel.exchange=nccl"]),
            2,
            "parallel.exchange = \"nccl\" needs GPUs",
        ),
        (train(&["parallel.exchange=gloo"]), 2, "parallel.exchange"),
        (
            train(&["checkpoint.keep_last=0"]),
            2,
            "checkpoint.keep_last = 0",
        ),
        (train(&["checkpoint.keep_last=1000000"]), 2, "at most 10000"),
        (train(&["devices.count=0"]), 2, "devices.count = 0"),
        (train(&["devices.count=5000"]), 2, "devices.count = 5000"),
        (train(&["devices.use=[-1]"]), 2, "--set devices.use=[-1]"),
        (
            train(&["train.early_stop_patience=2", "eval.every_epochs=0"]),
            2,
            "set eval.every_epochs to evaluate during training",
        ),
        (
            train(&["train.early_stop_patience=1", "eval.every_epochs=3"]),
            2,
            "at least eval.every_epochs = 3",
        ),
        (
            train(&["train.early_stop_patience=1000000"]),
            2,
            "at most 100000",
        ),
        (
            train(&["train.early_stop_min_delta=1.5"]),
            2,
            "train.early_stop_min_delta = 1.5",
        ),
        (
            train(&["train.early_stop_min_delta=-0.1"]),
            2,
            "train.early_stop_min_delta",
        ),
        (
            train(&["devices.use=some"]),
            2,
            "a list of logical GPU indices",
        ),
        (
            train(&["devices.use=[0]", "devices.main=3"]),
            2,
            "devices.main = 3",
        ),
        (train(&["devices.backend=tpu"]), 2, "devices.backend"),
        (train(&["devices.visible=x,1"]), 2, "devices.visible"),
        (
            train(&["faults.inject=error", "faults.step=0"]),
            2,
            "faults.step = 0",
        ),
        (
            train(&["watchdog.hang_timeout_s=-5"]),
            2,
            "watchdog.hang_timeout_s = -5",
        ),
        (train(&["data.root=a\nb"]), 2, "line break"),
        (
            train(&["train.batch_szie=3"]),
            2,
            "did you mean `train.batch_size`",
        ),
        (train(&["nosuch.key=3"]), 2, "unknown key `nosuch.key`"),
        (train(&["train=3"]), 2, "is a section"),
        (train(&["train.epochs"]), 2, "expected key=value"),
        (train(&["=3"]), 2, "the key is empty"),
        (
            vec![s("train"), s("--config"), s("/no/such/config.toml")],
            2,
            "/no/such/config.toml",
        ),
        (
            vec![s("train"), s("--config"), p(&garbage)],
            2,
            "not valid TOML",
        ),
        (
            vec![s("train"), s("--config"), p(&binary)],
            2,
            "binary.toml",
        ),
        (vec![s("train")], 2, "kiln train needs --config FILE"),
        (vec![s("train"), s("--resume")], 2, "needs --config"),
        (
            vec![s("train"), s("--resume"), p(&not_run)],
            2,
            "not a kiln run directory",
        ),
        (
            vec![s("train"), s("--config"), s(DEBUG_TOML), s("--devices=-1")],
            2,
            "--devices",
        ),
        (
            vec![
                s("train"),
                s("--config"),
                s(DEBUG_TOML),
                s("--devices"),
                s("0,x"),
            ],
            2,
            "GPU indices",
        ),
        (
            vec![
                s("train"),
                s("--config"),
                s(DEBUG_TOML),
                s("--max-restarts"),
                s("-1"),
            ],
            2,
            "unexpected argument '-1'",
        ),
        (
            vec![s("eval"), s("--run"), p(&not_run)],
            2,
            "not a kiln run directory",
        ),
        (
            vec![s("eval"), s("--run"), p(&not_run), s("--split"), s("valid")],
            2,
            "--split",
        ),
        (
            vec![
                s("launch"),
                s("--config"),
                s(DEBUG_TOML),
                s("--output"),
                o.clone(),
            ],
            2,
            "--nproc",
        ),
        (
            vec![
                s("launch"),
                s("--nproc"),
                s("0"),
                s("--config"),
                s(DEBUG_TOML),
                s("--output"),
                o.clone(),
            ],
            2,
            "--nproc 0",
        ),
        (
            vec![
                s("launch"),
                s("--nproc"),
                s("2"),
                s("--no-supervisor"),
                s("--config"),
                s(DEBUG_TOML),
            ],
            2,
            "drop --no-supervisor",
        ),
        (
            vec![
                s("sweep"),
                s("--config"),
                p(&big_sweep),
                s("--output"),
                o.clone(),
            ],
            2,
            "at most 100000",
        ),
        (
            vec![
                s("sweep"),
                s("--config"),
                p(&no_axes),
                s("--output"),
                o.clone(),
            ],
            2,
            "no axes",
        ),
        (
            vec![
                s("sweep"),
                s("--config"),
                p(&devices_axis),
                s("--output"),
                o.clone(),
            ],
            2,
            "places trials on GPUs itself",
        ),
        (
            vec![s("sweep"), s("--resume"), p(&not_run)],
            2,
            "is not a sweep folder",
        ),
        (
            vec![
                s("bench"),
                s("--model"),
                s("resnet19"),
                s("--steps"),
                s("1"),
            ],
            2,
            "resnet18",
        ),
        (
            vec![s("bench"), s("--precision"), s("fp8"), s("--steps"), s("1")],
            2,
            "train.precision",
        ),
        (
            vec![s("devices"), s("--set"), s("devices.visible=1")],
            2,
            "CUDA_VISIBLE_DEVICES=\"\"",
        ),
        (
            vec![s("warmup"), s("--config"), s("/no/such/config.toml")],
            2,
            "/no/such/config.toml",
        ),
        (vec![s("frobnicate")], 2, "unrecognized subcommand"),
    ];
    assert!(cases.len() >= 50, "{} cases", cases.len());
    // Environments a careful user got wrong.
    let env_cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("CUDA_VISIBLE_DEVICES", b"0,0".to_vec(), "names GPU 0 twice"),
        ("CUDA_VISIBLE_DEVICES", vec![0xff, 0x30], "is not text"),
    ];
    for (args, code, text) in cases.drain(..) {
        let o = Output::of(kiln().args(&args));
        check(&o, &args.join(" "), code, text);
    }
    for (name, value, text) in env_cases {
        let mut cmd = kiln();
        cmd.env(name, std::ffi::OsStr::from_bytes(&value))
            .args(["train", "--config", DEBUG_TOML, "--output"])
            .arg(&out);
        let o = Output::of(&mut cmd);
        check(&o, &format!("{name}={value:?}"), 2, text);
    }
    // None of them left a run behind.
    assert!(
        std::fs::read_dir(&out).map_or(true, |d| d.count() == 0),
        "bad inputs left runs in {}",
        out.display()
    );
}

fn check(o: &Output, what: &str, code: i32, text: &str) {
    assert_eq!(o.code, code, "{what}: exit code\n{}", o.stderr);
    assert!(
        o.stderr.contains(text),
        "{what}: stderr lacks {text:?}:\n{}",
        o.stderr
    );
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        assert!(!o.stderr.contains(bad), "{what}: {bad}:\n{}", o.stderr);
    }
    // One clear message: the error itself on one line.
    let errors = o.stderr.lines().filter(|l| l.contains("error")).count();
    assert!(errors <= 2, "{what}: {errors} error lines:\n{}", o.stderr);
}
