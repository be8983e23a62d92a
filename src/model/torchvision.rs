//! A kiln ResNet's weights and BatchNorm buffers under torchvision's state-dict names
//! and layouts (`conv1.weight`, `bn1.running_mean`, `layer1.0.conv1.weight`,
//! `layer2.0.downsample.0.weight`, `fc.weight`, ...), so that
//! `torchvision.models.resnet18(num_classes=N)` (its stem swapped for a 3x3 convolution
//! and no max-pool where kiln used the small stem) loads them with `strict=True`.
//!
//! burn-store lists the tensors with their module paths and turns Burn's layouts into
//! PyTorch's (Linear weights transposed, BatchNorm's gamma/beta named weight/bias);
//! here the paths become torchvision's names. The CIFAR ResNets (20/32/56) and `tiny`
//! get the same scheme with three or two stages; torchvision has no such models.

use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn_store::{BurnToPyTorchAdapter, ModuleAdapter, ModuleSnapshot};

use super::flavors::layout;
use super::{ModelSpec, ResNet};

/// One entry of the state dict.
#[derive(Debug, Clone, PartialEq)]
pub struct StateTensor {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<usize>,
    /// Little-endian values.
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32,
    /// BatchNorm's `num_batches_tracked`.
    I64,
}

/// The state dict of `model` (of `spec`), its BatchNorm layers having tracked
/// `batches` batches. Sorted by name.
pub fn state_dict<B: Backend>(
    model: &ResNet<B>,
    spec: &ModelSpec,
    batches: u64,
) -> Result<Vec<StateTensor>, String> {
    let depths = layout(spec.arch).depths;
    let mut out = Vec::new();
    // Enum variant names (Basic/Bottleneck) are left out of the paths.
    for snap in model.collect(None, None, true) {
        let snap = BurnToPyTorchAdapter.adapt(&snap);
        let path = snap.full_path();
        let name = torchvision_name(&path, &depths)
            .ok_or_else(|| format!("no torchvision name for kiln's tensor {path}"))?;
        let data = snap
            .to_data()
            .map_err(|e| format!("reading {path}: {e:?}"))?
            .convert_dtype(DType::F32);
        let values = data
            .to_vec::<f32>()
            .map_err(|e| format!("reading {path}: {e:?}"))?;
        if name.ends_with(".running_var") {
            let module = name.trim_end_matches(".running_var");
            out.push(StateTensor {
                name: format!("{module}.num_batches_tracked"),
                kind: Kind::I64,
                shape: vec![],
                bytes: (batches as i64).to_le_bytes().to_vec(),
            });
        }
        out.push(StateTensor {
            name,
            kind: Kind::F32,
            shape: snap.shape.to_vec(),
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// torchvision's name for kiln's module path `path` (enum variants left out), the
/// stages having `depths` blocks each.
fn torchvision_name(path: &str, depths: &[usize]) -> Option<String> {
    let parts: Vec<&str> = path.split('.').collect();
    let renamed = match parts.as_slice() {
        ["stem_conv", p] => format!("conv1.{p}"),
        ["stem_bn", p] => format!("bn1.{p}"),
        ["fc", p] => format!("fc.{p}"),
        ["blocks", k, rest @ ..] => {
            let mut k: usize = k.parse().ok()?;
            let mut stage = 0;
            while k >= *depths.get(stage)? {
                k -= depths[stage];
                stage += 1;
            }
            let inner = match rest {
                ["shortcut", "conv", p] => format!("downsample.0.{p}"),
                ["shortcut", "bn", p] => format!("downsample.1.{p}"),
                [layer, p] if layer.starts_with("conv") || layer.starts_with("bn") => {
                    format!("{layer}.{p}")
                }
                _ => return None,
            };
            format!("layer{}.{k}.{inner}", stage + 1)
        }
        _ => return None,
    };
    Some(renamed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, Stem};
    use crate::test_util::{TestBackend, device, rng_lock};

    fn tensor<'a>(dict: &'a [StateTensor], name: &str) -> &'a StateTensor {
        dict.iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    }

    fn floats(t: &StateTensor) -> Vec<f32> {
        t.bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn resnet18_has_exactly_torchvisions_keys_and_shapes() {
        // Initialising draws from the shared generator that seeded tests replay.
        let _rng = rng_lock();
        let spec = ModelSpec::new(Arch::Resnet18, Stem::Imagenet, 3, 10, 224);
        let model = spec.init::<TestBackend>(&device());
        let dict = state_dict(&model, &spec, 7).unwrap();
        // torchvision.models.resnet18().state_dict() has 122 entries: 20 convolutions,
        // 20 BatchNorms of 5 entries each, and fc's two.
        assert_eq!(dict.len(), 122);
        let mut expected = vec!["conv1.weight".to_string()];
        let bn = |m: &str| {
            [
                "weight",
                "bias",
                "running_mean",
                "running_var",
                "num_batches_tracked",
            ]
            .map(|p| format!("{m}.{p}"))
        };
        expected.extend(bn("bn1"));
        for stage in 1..=4 {
            for block in 0..2 {
                let m = format!("layer{stage}.{block}");
                for c in 1..=2 {
                    expected.push(format!("{m}.conv{c}.weight"));
                    expected.extend(bn(&format!("{m}.bn{c}")));
                }
                if stage > 1 && block == 0 {
                    expected.push(format!("{m}.downsample.0.weight"));
                    expected.extend(bn(&format!("{m}.downsample.1")));
                }
            }
        }
        expected.extend(["fc.weight".to_string(), "fc.bias".to_string()]);
        expected.sort();
        let names: Vec<String> = dict.iter().map(|t| t.name.clone()).collect();
        assert_eq!(names, expected);
        assert_eq!(tensor(&dict, "conv1.weight").shape, vec![64, 3, 7, 7]);
        assert_eq!(
            tensor(&dict, "layer2.0.downsample.0.weight").shape,
            vec![128, 64, 1, 1]
        );
        assert_eq!(tensor(&dict, "layer4.1.bn2.running_var").shape, vec![512]);
        let tracked = tensor(&dict, "layer3.0.bn1.num_batches_tracked");
        assert_eq!((tracked.kind, tracked.shape.len()), (Kind::I64, 0));
        assert_eq!(tracked.bytes, 7i64.to_le_bytes());
    }

    #[test]
    fn fc_is_out_by_in_and_batchnorm_keeps_its_values() {
        // Initialising draws from the shared generator that seeded tests replay.
        let _rng = rng_lock();
        let spec = ModelSpec::new(Arch::Resnet18, Stem::Small, 1, 10, 28);
        let model = spec.init::<TestBackend>(&device());
        let dict = state_dict(&model, &spec, 0).unwrap();
        assert_eq!(tensor(&dict, "conv1.weight").shape, vec![64, 1, 3, 3]);
        // Burn stores Linear as [in, out]; PyTorch as [out, in].
        let fc = tensor(&dict, "fc.weight");
        assert_eq!(fc.shape, vec![10, 512]);
        let burn_fc: Vec<f32> = model
            .collect(None, None, true)
            .into_iter()
            .find(|s| s.full_path() == "fc.weight")
            .unwrap()
            .to_data()
            .unwrap()
            .to_vec()
            .unwrap();
        let exported = floats(fc);
        for (i, o) in [(0, 0), (3, 7), (511, 9)] {
            assert_eq!(exported[o * 512 + i], burn_fc[i * 10 + o]);
        }
        assert!(
            floats(tensor(&dict, "bn1.weight"))
                .iter()
                .all(|v| *v == 1.0)
        );
        assert!(
            floats(tensor(&dict, "bn1.running_var"))
                .iter()
                .all(|v| *v == 1.0)
        );
    }

    #[test]
    fn resnet50_blocks_map_to_stages_by_their_depths() {
        // Initialising draws from the shared generator that seeded tests replay.
        let _rng = rng_lock();
        let spec = ModelSpec::new(Arch::Resnet50, Stem::Imagenet, 3, 1000, 224);
        let model = spec.init::<TestBackend>(&device());
        let dict = state_dict(&model, &spec, 0).unwrap();
        // torchvision.models.resnet50().state_dict() has 320 entries.
        assert_eq!(dict.len(), 320);
        assert_eq!(
            tensor(&dict, "layer3.5.conv3.weight").shape,
            vec![1024, 256, 1, 1]
        );
        assert_eq!(
            tensor(&dict, "layer4.0.conv2.weight").shape,
            vec![512, 512, 3, 3]
        );
        assert_eq!(
            tensor(&dict, "layer1.0.downsample.0.weight").shape,
            vec![256, 64, 1, 1]
        );
        assert!(dict.iter().all(|t| !t.name.starts_with("layer5")));
    }

    #[test]
    fn names_outside_the_network_are_refused() {
        assert_eq!(
            torchvision_name("blocks.8.conv1.weight", &[2, 2, 2, 2]),
            None
        );
        assert_eq!(torchvision_name("pool.weight", &[2, 2]), None);
        assert_eq!(
            torchvision_name("blocks.4.shortcut.bn.running_mean", &[3, 3, 3]).unwrap(),
            "layer2.1.downsample.1.running_mean"
        );
    }
}
