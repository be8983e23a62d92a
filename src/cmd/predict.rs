//! `kiln predict`: the classes a run's saved model sees in image files.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::cli::{PredictArgs, Which};
use crate::exit::UsageError;
use crate::train::backend::with_backend;
use crate::train::{PredictJob, pick_checkpoint, top_k};

pub fn run(args: PredictArgs) -> anyhow::Result<ExitCode> {
    let mut sets = args.sets.clone();
    if let Some(spec) = &args.devices {
        sets.push(crate::cli::devices_override(spec));
    }
    let config = super::setup::run_config(&args.run, &sets, "predict")?;
    if args.top_k == 0 {
        return Err(UsageError("--top-k 0: ask for at least one class".into()).into());
    }
    let files = image_files(&args.images)?;
    let (checkpoint, state) = pick_checkpoint(&args.run, args.checkpoint == Which::Best)?;
    let input = super::setup::network_input(&state.input, &config)?;
    let classes = state.classes.clone();
    let plan = super::setup::plan_devices(&config.devices)?;
    let kernels = super::setup::kernel_settings(&config, &plan)?;
    let loader = crate::data::file_loader(
        files.clone(),
        &input,
        config.train.batch_size.min(256),
        config.data.num_workers,
    );
    let probs = with_backend(
        &plan,
        &kernels,
        PredictJob {
            checkpoint,
            state,
            loader,
        },
    )
    .map_err(|e| match e {
        // An image that cannot be read is the user's to fix, as in a dataset.
        crate::train::TrainError::Data(d) => anyhow::Error::from(d),
        other => other.into(),
    })?;
    let ranked: Vec<(PathBuf, Vec<(usize, f32)>)> = files
        .into_iter()
        .zip(probs)
        .map(|(f, p)| (f, top_k(&p, args.top_k)))
        .collect();
    if args.json {
        let rows: Vec<serde_json::Value> = ranked
            .iter()
            .map(|(f, top)| {
                serde_json::json!({
                    "file": f.display().to_string(),
                    "top": top.iter().map(|(c, p)| serde_json::json!({
                        "class": classes[*c],
                        "index": c,
                        "probability": p,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        crate::out!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        for (f, top) in &ranked {
            let guesses: Vec<String> = top
                .iter()
                .map(|(c, p)| format!("{} {:.1}%", classes[*c], p * 100.0))
                .collect();
            crate::out!("{}: {}", f.display(), guesses.join(", "));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The images `args` names: files as given, folders searched (recursively) for PNG and
/// JPEG files, each folder's in name order.
fn image_files(args: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for a in args {
        if a.is_dir() {
            let before = files.len();
            walk(a, &mut files)?;
            if files.len() == before {
                return Err(UsageError(format!(
                    "{}: the folder holds no .png, .jpg or .jpeg file",
                    a.display()
                ))
                .into());
            }
        } else if a.is_file() {
            files.push(a.clone());
        } else {
            return Err(UsageError(format!("{}: no such file or folder", a.display())).into());
        }
    }
    Ok(files)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    let read = |e: std::io::Error| UsageError(format!("{}: cannot list it: {e}", dir.display()));
    // Linked folders are not followed: a link to a parent would never end.
    let mut entries: Vec<(PathBuf, bool)> = std::fs::read_dir(dir)
        .map_err(read)?
        .map(|e| e.and_then(|e| Ok((e.path(), e.file_type()?.is_dir()))))
        .collect::<Result<_, _>>()
        .map_err(read)?;
    entries.sort();
    for (p, is_dir) in entries {
        let hidden = p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if hidden {
            continue;
        }
        if is_dir {
            walk(&p, files)?;
        } else if crate::data::is_image_file(&p) {
            files.push(p);
        }
    }
    Ok(())
}
