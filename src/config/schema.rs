//! The configuration schema: one serde struct per TOML section, every field with
//! its unit, default and interactions. This is what the user typed (after `--set`);
//! resolving it against the machine (devices, dataset files) happens elsewhere.
//! Cross-field rules live in [`Config::validate`].

use serde::{Deserialize, Serialize};

use super::error::ConfigError;

/// The whole training configuration, as read from a TOML file plus `--set` overrides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub optim: OptimConfig,
    pub devices: DevicesConfig,
    pub checkpoint: CheckpointConfig,
    pub faults: FaultsConfig,
}

/// Which network to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// A 2-block, 8/16-channel ResNet for tests and smoke runs (like torchtitan's debugmodel).
    Tiny,
    /// CIFAR-style ResNets (He et al. 2016, section 4.2): 3 stages of 16/32/64 channels.
    Resnet20,
    Resnet32,
    Resnet56,
    /// ImageNet-style ResNets: 4 stages of 64..512 channels (ResNet-50: bottleneck blocks, x4).
    Resnet18,
    Resnet34,
    Resnet50,
}

/// The first layers of the network, before the residual stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stem {
    /// `small` for images of at most 64 px on their shorter side, else `imagenet`.
    Auto,
    /// 3x3 convolution, stride 1, no max-pool: keeps the resolution of 28-32 px images.
    Small,
    /// 7x7 convolution, stride 2, then a 3x3 max-pool of stride 2: for 224 px images.
    Imagenet,
}

/// `[model]`: the network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Network family member. Input channels and class count come from the dataset.
    pub arch: Arch,
    /// Stem layers; `auto` chooses from the image size.
    pub stem: Stem,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            arch: Arch::Resnet20,
            stem: Stem::Auto,
        }
    }
}

/// Which dataset reader to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    /// Fashion-MNIST IDX files (gzip or raw), 28x28 grey, 10 classes.
    FashionMnist,
    /// MNIST digits in the same IDX format (no horizontal flips: digits are not symmetric).
    Mnist,
    /// The CIFAR-10 binary archive (`cifar-10-batches-bin/`), 32x32 RGB, 10 classes.
    Cifar10,
    /// `ROOT/{train,test}/CLASS/*.{png,jpg}`; classes are the sub-folder names, sorted.
    ImageFolder,
    /// Random images with learnable class-dependent means, for benchmarks and tests.
    Synthetic,
}

impl DatasetKind {
    /// Where `data.root = ""` points, relative to the working directory.
    pub fn default_root(self) -> &'static str {
        match self {
            DatasetKind::FashionMnist => "datasets/fashion-mnist",
            DatasetKind::Mnist => "datasets/mnist",
            DatasetKind::Cifar10 => "datasets/cifar-10-batches-bin",
            DatasetKind::ImageFolder => "datasets/images",
            DatasetKind::Synthetic => "",
        }
    }
}

/// Horizontal flips during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flip {
    /// On for natural images and clothes, off for MNIST digits.
    Auto,
    On,
    Off,
}

/// `[data]`: what to read and how to feed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub dataset: DatasetKind,
    /// Dataset location. Empty: the dataset's usual place under `datasets/` (for
    /// `cifar10`, a folder holding `data_batch_1.bin`..`test_batch.bin` or its parent).
    /// Relative paths are taken from the working directory; the run dir records the
    /// absolute path.
    pub root: String,
    /// Side of the square images fed to the network, in pixels. 0: the dataset's own
    /// size (image folders: the size of the first image). Other sizes are resized.
    pub image_size: u32,
    /// Random crop after zero-padding each side by this many pixels (train only). 0: off.
    pub crop_padding: u32,
    /// Random horizontal flips (train only).
    pub hflip: Flip,
    /// Use at most this many training images (the first ones). 0: all.
    pub max_train_samples: usize,
    /// Use at most this many test images. 0: all.
    pub max_test_samples: usize,
    /// Threads that decode, augment and batch, off the training thread. At least 1.
    pub num_workers: usize,
    /// Batches prepared ahead of the training thread. At least 1.
    pub prefetch: usize,
    /// CUDA: each batch is copied into a page-locked host buffer (from a pool that is
    /// reused) and uploaded from there on kiln's own stream, so the copy engine reads
    /// it while cubecl's device thread goes on launching kernels; `false`: cubecl's
    /// pageable upload. No effect on the CPU, where nothing is uploaded.
    pub pin_memory: bool,
    /// `synthetic` only: number of training images.
    pub synthetic_train_size: usize,
    /// `synthetic` only: number of test images.
    pub synthetic_test_size: usize,
    /// `synthetic` only: number of classes.
    pub synthetic_classes: usize,
    /// `synthetic` only: channels per image.
    pub synthetic_channels: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            dataset: DatasetKind::FashionMnist,
            root: String::new(),
            image_size: 0,
            crop_padding: 4,
            hflip: Flip::Auto,
            max_train_samples: 0,
            max_test_samples: 0,
            num_workers: 4,
            prefetch: 4,
            pin_memory: true,
            synthetic_train_size: 10_240,
            synthetic_test_size: 1_024,
            synthetic_classes: 10,
            synthetic_channels: 3,
        }
    }
}

/// How hard cubecl searches for the fastest kernel of each new shape (CUDA only).
/// Results are cached, so only the first run on a machine pays for the search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Autotune {
    /// cubecl's `minimal`: fewest shape groups, shortest first steps.
    Fast,
    /// cubecl's default.
    Balanced,
    /// cubecl's `extensive`.
    Extensive,
    /// cubecl's `full`: tunes every shape on its own.
    Full,
}

/// Which kernels run convolutions on CUDA (forward and both gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Convolution {
    /// cuDNN when it can be loaded (`libcudnn.so.9` on the library path), otherwise
    /// Burn's kernels, with a note saying why.
    Auto,
    /// As `auto`, but an error before training starts when cuDNN cannot be loaded.
    Cudnn,
    /// Burn's own implicit-GEMM kernels.
    Burn,
}

/// Which kernels run BatchNorm's training pass on CUDA (batch statistics, forward and
/// backward). Evaluation always uses Burn's element-wise pass with the running
/// statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchNormKernels {
    /// Channels-last layers on kiln's own kernels (`ops::channels_last_norm`); NCHW
    /// layers on cuDNN's batch normalisation (one kernel each way per layer) when cuDNN
    /// can be loaded, otherwise Burn's operations, with a note saying why.
    Auto,
    /// cuDNN in both layouts, or an error before training starts when it cannot be
    /// loaded.
    Cudnn,
    /// Burn's element-wise and reduction operations (about a dozen per layer forward).
    Burn,
}

/// Number format of the training arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// f32 everywhere (Burn runs f32 matmuls as TF32 on the tensor cores).
    Fp32,
    /// Mixed precision: convolutions and the classifier in bfloat16 on fp32 master
    /// weights; BatchNorm, loss and optimizer in fp32 (`model::precision`).
    Bf16,
    /// The same in float16, with dynamic loss scaling (`train::loss_scale`).
    Fp16,
}

/// How the data-parallel learner combines the replicas' gradients (several devices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// DataParallel: gradients summed on the main device, one optimizer step there, the
    /// new weights copied to the other devices with the next step's work.
    Dp,
    /// Every replica keeps its model and optimizer; the summed gradients go back to each
    /// device, which takes the same optimizer step as the main one.
    Ddp,
}

/// `[train]`: the loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Passes over the training set.
    pub epochs: u32,
    /// Stop after this many optimizer steps, even mid-epoch (a checkpoint is written).
    /// 0: run all epochs. The LR schedule is still laid out over all epochs.
    pub max_steps: u64,
    /// Images per optimizer step (the global batch), whatever the number of devices
    /// and accumulation steps. The last, smaller batch of an epoch is dropped.
    pub batch_size: usize,
    /// Split each global batch into this many micro-batches whose gradients are summed
    /// before one optimizer step. Must divide `batch_size`.
    pub grad_accum_steps: usize,
    /// Seeds weight initialisation, data order and augmentation. The same seed on the
    /// CPU gives the same run.
    pub seed: u64,
    /// Cross-entropy label smoothing in [0, 1).
    pub label_smoothing: f64,
    /// Clip the global L2 norm of all gradients to this value. 0: off.
    pub grad_clip_norm: f64,
    /// Evaluate on the test split every this many epochs (and after the last). 0: only
    /// after the last epoch.
    pub eval_every_epochs: u32,
    /// Print a progress line every this many steps when stderr is not a terminal.
    pub log_every_steps: u64,
    /// A step that takes longer than this many seconds counts as a hang: the process
    /// records which device it waited for and exits (75) so the supervisor restarts
    /// it. 0: automatic (the larger of 300 s and 50 times the median step). The first
    /// step of a process (kernel compilation) is not watched.
    pub hang_timeout_s: f64,
    /// Kernel autotuning on CUDA; ignored on the CPU.
    pub autotune: Autotune,
    /// Convolution kernels on CUDA: `auto`, `cudnn` or `burn`; the CPU runs Burn's.
    pub convolution: Convolution,
    /// BatchNorm's training kernels on CUDA: `auto`, `cudnn` or `burn`; the CPU runs
    /// Burn's operations.
    pub batch_norm: BatchNormKernels,
    /// Relative share of each global batch per device, in the order of the devices
    /// used (e.g. `[3, 1]`); empty: equal shares. Only with several devices.
    pub device_weights: Vec<f64>,
    /// Number format of the training arithmetic: `fp32`, or `bf16` / `fp16` mixed precision.
    pub precision: Precision,
    /// Activations as `[N, H, W, C]` and convolution weights as `[K, R, S, C]` inside
    /// the network (`model::precision`); with bf16/fp16 the activations also stay in
    /// the low precision between layers. On CUDA it needs cuDNN's convolutions and batch
    /// norm on kiln's or cuDNN's kernels, and the run stops before training without them.
    pub channels_last: bool,
    /// `dp` or `ddp` (see `Strategy`); only with several devices. `ddp` by default: it
    /// measured faster on two H200s (BENCHMARKS.md), since `dp` copies the weights out
    /// and the gradients in on the main thread, between steps.
    pub strategy: Strategy,
    /// Recompute memory-bound activations in the backward pass instead of keeping them
    /// (Burn's balanced checkpointing).
    pub gradient_checkpointing: bool,
    /// With several devices: consecutive weights or gradients of up to this many MiB
    /// cross between host and device in one transfer; 0: one transfer per tensor.
    pub transfer_bucket_mib: u64,
    /// Batch statistics over all replicas' shards. Not available: `false` keeps each
    /// shard's own statistics (running statistics stay identical across replicas).
    pub sync_batchnorm: bool,
    /// Require bitwise-repeatable training: the same seed gives the same weights on the
    /// same device. The CPU backend is; CUDA runs are refused (cmd::train says why).
    pub deterministic: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            epochs: 30,
            max_steps: 0,
            batch_size: 128,
            grad_accum_steps: 1,
            seed: 0,
            label_smoothing: 0.0,
            grad_clip_norm: 0.0,
            eval_every_epochs: 1,
            log_every_steps: 100,
            hang_timeout_s: 0.0,
            autotune: Autotune::Balanced,
            convolution: Convolution::Auto,
            batch_norm: BatchNormKernels::Auto,
            device_weights: Vec::new(),
            precision: Precision::Fp32,
            channels_last: false,
            strategy: Strategy::Ddp,
            gradient_checkpointing: false,
            transfer_bucket_mib: 0,
            sync_batchnorm: false,
            deterministic: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// SGD with (optionally Nesterov) momentum and L2 weight decay, as `torch.optim.SGD`.
    Sgd,
    /// Adam with decoupled weight decay, as `torch.optim.AdamW`.
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// `lr` throughout (after warmup).
    Constant,
    /// Half-cosine from `lr` down to `min_lr` over the run (after warmup).
    Cosine,
    /// 1cycle (Smith 2018): cosine up from `lr / onecycle_div` to `lr` over
    /// `onecycle_pct_start` of the run, then cosine down to `lr / onecycle_final_div`.
    Onecycle,
    /// Multiply by `step_gamma` at each epoch in `step_milestones`.
    Step,
}

/// `[optim]`: optimizer and learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    pub name: OptimizerKind,
    /// Peak learning rate.
    pub lr: f64,
    /// SGD momentum (dampening 0, as PyTorch).
    pub momentum: f64,
    /// SGD: Nesterov momentum.
    pub nesterov: bool,
    /// SGD: L2 penalty added to the gradient. AdamW: decoupled decay rate.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    pub schedule: ScheduleKind,
    /// Linear warmup from 0 over this many epochs (fractions allowed). Not used by `onecycle`.
    pub warmup_epochs: f64,
    /// `cosine`: the final learning rate.
    pub min_lr: f64,
    /// `step`: epochs at which the learning rate is multiplied by `step_gamma`.
    pub step_milestones: Vec<u32>,
    /// `step`: the factor applied at each milestone.
    pub step_gamma: f64,
    /// `onecycle`: fraction of the run spent increasing the learning rate.
    pub onecycle_pct_start: f64,
    /// `onecycle`: initial learning rate is `lr / onecycle_div`.
    pub onecycle_div: f64,
    /// `onecycle`: final learning rate is `lr / onecycle_final_div`.
    pub onecycle_final_div: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            name: OptimizerKind::Sgd,
            lr: 0.1,
            momentum: 0.9,
            nesterov: false,
            weight_decay: 5e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            schedule: ScheduleKind::Cosine,
            warmup_epochs: 0.0,
            min_lr: 0.0,
            step_milestones: Vec::new(),
            step_gamma: 0.1,
            onecycle_pct_start: 0.3,
            onecycle_div: 25.0,
            onecycle_final_div: 1e4,
        }
    }
}

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// CUDA when a driver and a GPU are present, else the CPU with a notice.
    Auto,
    /// CUDA; an error when no usable GPU is found.
    Cuda,
    /// The CPU backend (Burn's Flex), even where a GPU is present.
    Cpu,
}

/// Which of the visible GPUs to use (`devices.use`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Every visible GPU.
    All,
    /// `devices.count` GPUs with the most free memory (at least `min_free_mib`),
    /// preferring well-connected sets.
    Auto,
    /// These logical CUDA indices (after `CUDA_VISIBLE_DEVICES`), in this order.
    List(Vec<usize>),
}

impl Serialize for Selection {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Selection::All => s.serialize_str("all"),
            Selection::Auto => s.serialize_str("auto"),
            Selection::List(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Selection {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Selection;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"all\", \"auto\" or a list of logical GPU indices such as [0, 1]")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Selection, E> {
                match v {
                    "all" => Ok(Selection::All),
                    "auto" => Ok(Selection::Auto),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Selection, E> {
                usize::try_from(v)
                    .map(|i| Selection::List(vec![i]))
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Selection, A::Error> {
                let mut out = Vec::new();
                while let Some(i) = seq.next_element::<usize>()? {
                    out.push(i);
                }
                if out.is_empty() {
                    return Err(serde::de::Error::invalid_length(0, &self));
                }
                Ok(Selection::List(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[devices]`: where training runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicesConfig {
    pub backend: BackendChoice,
    /// Sets `CUDA_VISIBLE_DEVICES` for this process before CUDA starts, e.g. `"1,3"`.
    /// Empty: leave the environment as it is. A different value already in the
    /// environment is an error.
    pub visible: String,
    /// Which visible GPUs to use: `"all"`, `"auto"` or logical indices like `[0, 1]`.
    #[serde(rename = "use")]
    pub select: Selection,
    /// With `use = "auto"`: how many GPUs.
    pub count: usize,
    /// GPUs with less free memory than this (MiB, from NVML) are not used; naming one
    /// in `use` is an error.
    pub min_free_mib: u64,
    /// With `backend = "auto"`: refuse to fall back to the CPU.
    pub require_gpu: bool,
    /// Position in the chosen GPUs of the main device, which holds metrics (and, in
    /// data-parallel mode, the optimizer).
    pub main: usize,
    /// Where compiled CUDA kernels and autotune results are kept between runs. Empty:
    /// `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`.
    pub cache_dir: String,
}

impl Default for DevicesConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            visible: String::new(),
            select: Selection::All,
            count: 1,
            min_free_mib: 0,
            require_gpu: false,
            main: 0,
            cache_dir: String::new(),
        }
    }
}

/// `[checkpoint]`: when training state is saved and how many are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Also save every this many optimizer steps. 0: only at the end of each epoch
    /// (and when training stops early).
    pub every_steps: u64,
    /// Keep the newest this many checkpoints; older ones are deleted once a newer one
    /// is complete on disk. At least 1.
    pub keep_last: usize,
    /// Also keep the checkpoint with the best test accuracy.
    pub keep_best: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every_steps: 0,
            keep_last: 2,
            keep_best: true,
        }
    }
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// No fault (the default).
    None,
    /// The device's step returns an error, as a failed CUDA call would.
    Error,
    /// The device's thread panics, as cubecl does on many CUDA faults.
    Panic,
    /// The device's step never finishes, as a hung GPU would.
    Hang,
}

/// `[faults]`: fault injection for testing recovery. Off unless asked; fires once per
/// run (a restarted run does not fail again).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultsConfig {
    pub inject: FaultKind,
    /// Position, among the devices used, of the device that fails.
    pub device: usize,
    /// Optimizer step (1-based) during which it fails.
    pub step: u64,
}

impl Default for FaultsConfig {
    fn default() -> Self {
        Self {
            inject: FaultKind::None,
            device: 0,
            step: 1,
        }
    }
}

impl Config {
    /// SHA-256 of what decides the training's numbers: everything but `[devices]`
    /// and `[faults]`, which say where it runs (a restart on fewer GPUs keeps the hash).
    pub fn training_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let training = Config {
            devices: DevicesConfig::default(),
            faults: FaultsConfig::default(),
            ..self.clone()
        };
        let text = toml::to_string(&training).unwrap_or_else(|e| format!("{training:?} {e}"));
        Sha256::digest(text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Rules that involve more than one field or a range serde cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: String, allowed: &str| {
            Err(ConfigError::Invalid {
                key: key.to_string(),
                value,
                allowed: allowed.to_string(),
            })
        };
        let t = &self.train;
        if t.epochs == 0 {
            return bad("train.epochs", t.epochs.to_string(), "at least 1");
        }
        if t.batch_size == 0 {
            return bad("train.batch_size", "0".into(), "at least 1");
        }
        if t.grad_accum_steps == 0 || !t.batch_size.is_multiple_of(t.grad_accum_steps) {
            return bad(
                "train.grad_accum_steps",
                t.grad_accum_steps.to_string(),
                &format!(
                    "a divisor of train.batch_size = {} (each micro-batch has batch_size / grad_accum_steps images)",
                    t.batch_size
                ),
            );
        }
        if !(0.0..1.0).contains(&t.label_smoothing) {
            return bad(
                "train.label_smoothing",
                t.label_smoothing.to_string(),
                "a number in [0, 1)",
            );
        }
        if !(t.grad_clip_norm >= 0.0 && t.grad_clip_norm.is_finite()) {
            return bad(
                "train.grad_clip_norm",
                t.grad_clip_norm.to_string(),
                "0 (off) or a positive number",
            );
        }
        if t.device_weights
            .iter()
            .any(|w| !(w.is_finite() && *w > 0.0))
        {
            return bad(
                "train.device_weights",
                format!("{:?}", t.device_weights),
                "positive numbers, one per device used (or [] for equal shares)",
            );
        }
        if t.sync_batchnorm {
            return bad(
                "train.sync_batchnorm",
                "true".into(),
                "false: synchronised BatchNorm needs the replicas to exchange batch statistics inside every forward and backward pass, which this Burn version's modules cannot do; each device normalises its own shard (use shards of 32 or more images per device)",
            );
        }
        if t.log_every_steps == 0 {
            return bad("train.log_every_steps", "0".into(), "at least 1");
        }
        let d = &self.data;
        if d.num_workers == 0 {
            return bad(
                "data.num_workers",
                "0".into(),
                "at least 1 (loading always runs off the training thread)",
            );
        }
        if d.prefetch == 0 {
            return bad("data.prefetch", "0".into(), "at least 1");
        }
        if d.image_size > 4096 {
            return bad(
                "data.image_size",
                d.image_size.to_string(),
                "0 (the dataset's size) or at most 4096",
            );
        }
        if d.dataset == DatasetKind::Synthetic {
            if d.synthetic_classes < 2 {
                return bad(
                    "data.synthetic_classes",
                    d.synthetic_classes.to_string(),
                    "at least 2",
                );
            }
            if d.synthetic_channels == 0 || d.synthetic_channels > 4 {
                return bad(
                    "data.synthetic_channels",
                    d.synthetic_channels.to_string(),
                    "1 to 4",
                );
            }
            if d.synthetic_train_size == 0 || d.synthetic_test_size == 0 {
                return bad(
                    "data.synthetic_train_size",
                    format!("{} / {}", d.synthetic_train_size, d.synthetic_test_size),
                    "at least 1 image in each split (data.synthetic_test_size too)",
                );
            }
        }
        let o = &self.optim;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return bad("optim.lr", o.lr.to_string(), "a positive number");
        }
        if !(0.0..1.0).contains(&o.momentum) {
            return bad(
                "optim.momentum",
                o.momentum.to_string(),
                "a number in [0, 1)",
            );
        }
        if o.nesterov && o.momentum == 0.0 {
            return bad(
                "optim.nesterov",
                "true".into(),
                "false when optim.momentum = 0 (Nesterov needs momentum)",
            );
        }
        if !(o.weight_decay >= 0.0 && o.weight_decay.is_finite()) {
            return bad(
                "optim.weight_decay",
                o.weight_decay.to_string(),
                "0 or a positive number",
            );
        }
        for (key, v) in [("optim.beta1", o.beta1), ("optim.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return bad(key, v.to_string(), "a number in [0, 1)");
            }
        }
        if o.eps.is_nan() || o.eps <= 0.0 {
            return bad("optim.eps", o.eps.to_string(), "a positive number");
        }
        if !(o.warmup_epochs >= 0.0 && o.warmup_epochs <= t.epochs as f64) {
            return bad(
                "optim.warmup_epochs",
                o.warmup_epochs.to_string(),
                &format!("a number from 0 to train.epochs = {}", t.epochs),
            );
        }
        if !(o.min_lr >= 0.0 && o.min_lr <= o.lr) {
            return bad(
                "optim.min_lr",
                o.min_lr.to_string(),
                &format!("from 0 to optim.lr = {}", o.lr),
            );
        }
        if o.step_gamma.is_nan() || o.step_gamma <= 0.0 {
            return bad(
                "optim.step_gamma",
                o.step_gamma.to_string(),
                "a positive number",
            );
        }
        if o.schedule == ScheduleKind::Step {
            if o.step_milestones.windows(2).any(|w| w[0] >= w[1]) {
                return bad(
                    "optim.step_milestones",
                    format!("{:?}", o.step_milestones),
                    "epochs in increasing order",
                );
            }
            if o.step_milestones.is_empty() {
                return bad(
                    "optim.step_milestones",
                    "[]".into(),
                    "at least one epoch when optim.schedule = \"step\"",
                );
            }
        }
        if !(o.onecycle_pct_start > 0.0 && o.onecycle_pct_start < 1.0) {
            return bad(
                "optim.onecycle_pct_start",
                o.onecycle_pct_start.to_string(),
                "a number in (0, 1)",
            );
        }
        for (key, v) in [
            ("optim.onecycle_div", o.onecycle_div),
            ("optim.onecycle_final_div", o.onecycle_final_div),
        ] {
            if v.is_nan() || v < 1.0 {
                return bad(key, v.to_string(), "a number of at least 1");
            }
        }
        let dv = &self.devices;
        if dv.count == 0 {
            return bad("devices.count", "0".into(), "at least 1");
        }
        if let Selection::List(ids) = &dv.select
            && dv.main >= ids.len()
        {
            return bad(
                "devices.main",
                dv.main.to_string(),
                &format!(
                    "a position in devices.use = {ids:?}, 0 to {}",
                    ids.len() - 1
                ),
            );
        }
        if !(t.hang_timeout_s >= 0.0 && t.hang_timeout_s.is_finite()) {
            return bad(
                "train.hang_timeout_s",
                t.hang_timeout_s.to_string(),
                "0 (automatic) or a number of seconds",
            );
        }
        if self.faults.inject != FaultKind::None && self.faults.step == 0 {
            return bad("faults.step", "0".into(), "a step number from 1");
        }
        if self.checkpoint.keep_last == 0 {
            return bad(
                "checkpoint.keep_last",
                "0".into(),
                "at least 1 (resume needs a checkpoint)",
            );
        }
        Ok(())
    }
}
