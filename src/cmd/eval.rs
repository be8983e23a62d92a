//! `kiln eval`: a run's saved model on its dataset, in inference mode.

use std::process::ExitCode;

use crate::cli::{EvalArgs, Split, Which};
use crate::config;
use crate::exit::UsageError;
use crate::train::backend::with_backend;
use crate::train::{EvalJob, pick_checkpoint};

pub fn run(args: EvalArgs) -> anyhow::Result<ExitCode> {
    let config_path = args.run.join("config.toml");
    if !config_path.is_file() {
        return Err(UsageError(format!(
            "--run {}: not a kiln run directory (no config.toml)",
            args.run.display()
        ))
        .into());
    }
    // The model is the checkpoint's own: a [model] key could only be ignored.
    if let Some(s) = args
        .sets
        .iter()
        .find(|s| s.trim_start().starts_with("model."))
    {
        return Err(UsageError(format!(
            "--set {s}: kiln eval evaluates the model the run trained, as its checkpoint holds it; [model] keys cannot change it (the data, devices and batch size can be set)"
        ))
        .into());
    }
    let config = config::load(&config_path, &args.sets)?;
    let (checkpoint, state) = pick_checkpoint(&args.run, args.checkpoint == Which::Best)?;
    let plan = super::setup::plan_devices(&config.devices)?;
    let dataset = crate::data::open(&config.data, config.train.seed)?;
    if dataset.classes != state.classes {
        return Err(UsageError(format!(
            "the dataset at {} has classes [{}], the model was trained on [{}]",
            dataset.root.display(),
            dataset.classes.join(", "),
            state.classes.join(", ")
        ))
        .into());
    }
    let loader = dataset.eval_loader(
        &config.data,
        args.split == Split::Train,
        config.train.batch_size,
    );
    let images = loader.num_images();
    let step = state.step;
    let kernels = super::setup::kernel_settings(&config, &plan)?;
    let (loss, acc) = with_backend(
        &plan,
        &kernels,
        EvalJob {
            checkpoint: checkpoint.clone(),
            state,
            loader,
        },
    )?;
    crate::out!(
        "{} split: loss {loss:.4}, accuracy {:.2}% ({images} images; {} at step {step})",
        match args.split {
            Split::Train => "train",
            Split::Test => "test",
        },
        acc * 100.0,
        checkpoint.display()
    );
    Ok(ExitCode::SUCCESS)
}
