//! `kiln eval`: a run's saved model on its dataset, in inference mode.

use std::process::ExitCode;

use crate::cli::{EvalArgs, Split, Which};
use crate::exit::UsageError;
use crate::train::backend::with_backend;
use crate::train::{EvalJob, pick_checkpoint};

pub fn run(args: EvalArgs) -> anyhow::Result<ExitCode> {
    let config = super::setup::run_config(&args.run, &args.sets, "eval")?;
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
