//! What a trained run's model does outside training: `kiln predict` and `kiln export`.

use std::path::Path;

use super::{Output, kiln, run_dir, tempdir};

/// An image folder of two classes a tiny network tells apart: reddish and bluish
/// squares with noise.
fn colour_folder(root: &Path) {
    for (split, n) in [("train", 48), ("test", 8)] {
        for class in ["blue", "red"] {
            let dir = root.join(split).join(class);
            std::fs::create_dir_all(&dir).unwrap();
            for i in 0..n {
                let img = image::RgbImage::from_fn(8, 8, |x, y| {
                    let noise = ((x * 7 + y * 13 + i * 29) % 60) as u8;
                    if class == "red" {
                        image::Rgb([180 + noise, 40 + noise, 30])
                    } else {
                        image::Rgb([30, 40 + noise, 180 + noise])
                    }
                });
                img.save(dir.join(format!("{i}.png"))).unwrap();
            }
        }
    }
}

fn trained_run(name: &str) -> std::path::PathBuf {
    let root = tempdir(name);
    let data = root.join("data");
    colour_folder(&data);
    let out = root.join("runs");
    Output::of(
        kiln()
            .args(["train", "--config", super::DEBUG_TOML, "--output"])
            .arg(&out)
            .args(["--set", "data.dataset=image_folder", "--set"])
            .arg(format!("data.root={}", data.display()))
            .args(["--set", "train.epochs=3", "--set", "train.batch_size=16"]),
    )
    .success();
    run_dir(&out)
}

#[test]
fn predict_names_the_classes_of_image_files_and_folders() {
    let run = trained_run("predict");
    let data = run.parent().unwrap().parent().unwrap().join("data");
    let red = data.join("test/red/0.png");
    let out = Output::of(
        kiln()
            .args(["predict", "--run"])
            .arg(&run)
            .arg(&red)
            .arg(data.join("test/blue"))
            .args(["--top-k", "2"]),
    );
    out.success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 9, "{}", out.stdout);
    assert!(
        lines[0].starts_with(&format!("{}: red ", red.display())),
        "{}",
        out.stdout
    );
    assert!(
        lines[1..].iter().all(|l| l.contains(": blue ")),
        "{}",
        out.stdout
    );
    // JSON: both classes with probabilities summing to one.
    let out = Output::of(
        kiln()
            .args(["predict", "--json", "--run"])
            .arg(&run)
            .arg(&red),
    );
    out.success();
    let rows: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let top = rows[0]["top"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[0]["class"], "red");
    let sum: f64 = top.iter().map(|t| t["probability"].as_f64().unwrap()).sum();
    assert!((sum - 1.0).abs() < 1e-4, "{sum}");
    // Mistakes are named.
    Output::of(
        kiln()
            .args(["predict", "--run"])
            .arg(&run)
            .arg(data.join("no-such.png")),
    )
    .code(2)
    .stderr_has("no-such.png: no such file or folder");
    let not_image = data.join("notes.png");
    std::fs::write(&not_image, "not a picture").unwrap();
    Output::of(kiln().args(["predict", "--run"]).arg(&run).arg(&not_image))
        .code(2)
        .stderr_has("notes.png");
}

/// The safetensors header: tensor entries and metadata.
fn header(file: &Path) -> serde_json::Value {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).unwrap()
}

/// `kiln export` of `run` into `output`, with `flags` before the others.
fn export(run: &Path, flags: &[&str], output: &Path) -> Output {
    Output::of(
        kiln()
            .arg("export")
            .args(flags)
            .arg("--run")
            .arg(run)
            .arg("--output")
            .arg(output),
    )
}

#[test]
fn export_writes_torchvision_names_and_the_inputs_metadata() {
    let run = trained_run("export");
    let file = run.parent().unwrap().join("model.safetensors");
    export(&run, &[], &file).success().stdout_has("tensors");
    let h = header(&file);
    assert_eq!(h["conv1.weight"]["shape"], serde_json::json!([8, 3, 3, 3]));
    assert_eq!(h["fc.weight"]["shape"], serde_json::json!([2, 16]));
    assert_eq!(h["layer2.0.downsample.0.weight"]["dtype"], "F32");
    assert_eq!(h["bn1.num_batches_tracked"]["dtype"], "I64");
    let meta = &h["__metadata__"];
    assert_eq!(meta["classes"], r#"["blue","red"]"#);
    assert_eq!(meta["input_shape"], "[3,8,8]");
    assert_eq!(meta["format"], "pt");
    let mean: Vec<f64> = serde_json::from_str(meta["mean"].as_str().unwrap()).unwrap();
    assert_eq!(mean.len(), 3);
    // The file is the user's: not replaced without --force.
    export(&run, &[], &file).code(2).stderr_has("--force");
    export(&run, &["--force"], &file).success();
    export(&run, &[], &run.join("model.bin"))
        .code(2)
        .stderr_has(".safetensors");
}
