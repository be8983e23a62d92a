//! `kiln export`: a run's saved model as safetensors under torchvision's names, so
//! PyTorch loads it without kiln.

use std::collections::HashMap;
use std::process::ExitCode;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::cli::{ExportArgs, Which};
use crate::exit::UsageError;
use crate::model::torchvision::{Kind, state_dict};
use crate::train::{pick_checkpoint, read_model_on_cpu};

pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let config = super::setup::run_config(&args.run, &[], "export")?;
    if args.output.exists() && !args.force {
        return Err(UsageError(format!(
            "--output {}: the file exists; choose another name, or add --force to replace it",
            args.output.display()
        ))
        .into());
    }
    if args.output.extension().is_none_or(|e| e != "safetensors") {
        return Err(UsageError(format!(
            "--output {}: give the file the .safetensors extension, as PyTorch's loaders expect",
            args.output.display()
        ))
        .into());
    }
    let (checkpoint, state) = pick_checkpoint(&args.run, args.checkpoint == Which::Best)?;
    let input = super::setup::network_input(&state.input, &config)?;
    let model = read_model_on_cpu(&checkpoint, &state)?;
    let dict = state_dict(&model, &state.spec, state.step).map_err(anyhow::Error::msg)?;
    let views = dict
        .iter()
        .map(|t| {
            let dtype = match t.kind {
                Kind::F32 => Dtype::F32,
                Kind::I64 => Dtype::I64,
            };
            TensorView::new(dtype, t.shape.clone(), &t.bytes).map(|v| (t.name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let spec = state.spec;
    let arch = format!("{:?}", spec.arch).to_lowercase();
    let small = spec.stem == crate::config::Stem::Small;
    let accuracy = state
        .history
        .iter()
        .rev()
        .find(|r| r.step <= state.step && !r.test_acc.is_nan())
        .map(|r| format!("{:.4}", r.test_acc));
    let mut meta: HashMap<String, String> = HashMap::from([
        ("format".into(), "pt".into()),
        (
            "producer".into(),
            format!("kiln {}", env!("CARGO_PKG_VERSION")),
        ),
        ("arch".into(), arch.clone()),
        (
            "stem".into(),
            if small { "small" } else { "imagenet" }.into(),
        ),
        ("num_classes".into(), spec.num_classes.to_string()),
        ("classes".into(), serde_json::to_string(&state.classes)?),
        (
            "input_shape".into(),
            serde_json::to_string(&[input.channels, input.height, input.width])?,
        ),
        ("mean".into(), serde_json::to_string(&input.norm.mean)?),
        ("std".into(), serde_json::to_string(&input.norm.std)?),
        ("step".into(), state.step.to_string()),
        (
            "torchvision".into(),
            torchvision_recipe(&arch, spec.num_classes, small, spec.in_channels),
        ),
    ]);
    if let Some(a) = accuracy {
        meta.insert("test_accuracy".into(), a);
    }
    let bytes = safetensors::serialize(views, Some(meta))?;
    crate::report::write_atomic(&args.output, &bytes).map_err(|e| {
        UsageError(format!(
            "--output {}: cannot write it: {e}",
            args.output.display()
        ))
    })?;
    let params: usize = dict
        .iter()
        .filter(|t| t.kind == Kind::F32)
        .map(|t| t.shape.iter().product::<usize>())
        .sum();
    crate::out!(
        "wrote {}: {} tensors, {:.1}M values, from {} (step {})",
        args.output.display(),
        dict.len(),
        params as f64 / 1e6,
        checkpoint.display(),
        state.step
    );
    crate::out!(
        "load it in PyTorch: {}; model.load_state_dict(safetensors.torch.load_file(\"{}\"), strict=True)",
        torchvision_recipe(&arch, spec.num_classes, small, spec.in_channels),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The torchvision model that takes the exported state dict.
fn torchvision_recipe(arch: &str, classes: usize, small_stem: bool, channels: usize) -> String {
    if !matches!(arch, "resnet18" | "resnet34" | "resnet50") {
        return format!(
            "none ({arch} is not a torchvision model; the names follow torchvision's ResNet scheme)"
        );
    }
    let mut r = format!("model = torchvision.models.{arch}(num_classes={classes})");
    if small_stem {
        r.push_str(&format!(
            "; model.conv1 = torch.nn.Conv2d({channels}, 64, 3, 1, 1, bias=False); model.maxpool = torch.nn.Identity()"
        ));
    } else if channels != 3 {
        r.push_str(&format!(
            "; model.conv1 = torch.nn.Conv2d({channels}, 64, 7, 2, 3, bias=False)"
        ));
    }
    r
}
