//! `[parallel]`: how several devices (threads of one process, or processes) train one
//! model together: who steps the optimizer, how gradients are exchanged and in what.

use serde::{Deserialize, Serialize};

use super::error::{ConfigError, at_most};

/// Who takes the optimizer step when several devices train (several devices only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataParallel {
    /// DataParallel: the summed gradients are applied on the main device alone, whose
    /// new weights are copied to the other devices before the next step.
    Dp,
    /// DistributedDataParallel: every device keeps its model and optimizer and takes
    /// the same step on the same summed gradients.
    Ddp,
}

/// Which engine sums the gradients of several devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exchange {
    /// NCCL on CUDA (an error naming the library when it cannot be loaded), host memory
    /// on the CPU.
    Auto,
    /// NCCL all-reduces on the GPUs' buffers, queued on each device's CUDA stream; with
    /// one device too (a communicator of one: the path a multi-GPU run takes). CUDA only.
    Nccl,
    /// Through host memory: threads of one process sum on the host, processes over TCP
    /// through rank 0. What the CPU backend uses.
    Host,
}

/// The number format gradients travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeDtype {
    Fp32,
    /// Rounded to bfloat16 for the exchange (half the bytes, as PyTorch's
    /// `bf16_compress_hook`) and widened back to fp32 before the optimizer.
    Bf16,
}

/// `[parallel]`: several devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// `ddp` or `dp`; only with several devices.
    pub strategy: DataParallel,
    /// `auto`, `nccl` or `host`: which engine sums the gradients.
    pub exchange: Exchange,
    /// `fp32` or `bf16`: the format gradients travel in.
    pub exchange_dtype: ExchangeDtype,
    /// Consecutive gradients (in the order the backward pass makes them) travel
    /// together in buckets of up to this many MiB; 0: one per tensor.
    pub bucket_mib: u64,
    /// Relative share of each global batch per device, in the order of the devices
    /// used (e.g. `[3, 1]`); empty: equal shares. Threads of one process only.
    pub device_weights: Vec<f64>,
    /// Batch statistics over all replicas' shards. Not available: `false` keeps each
    /// shard's own statistics (running statistics stay identical across replicas).
    pub sync_batchnorm: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            strategy: DataParallel::Ddp,
            exchange: Exchange::Auto,
            exchange_dtype: ExchangeDtype::Fp32,
            bucket_mib: 25,
            device_weights: Vec::new(),
            sync_batchnorm: false,
        }
    }
}

impl ParallelConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        at_most(
            "parallel.bucket_mib",
            self.bucket_mib,
            4096,
            "MiB of gradients in one bucket",
        )?;
        at_most(
            "parallel.device_weights",
            self.device_weights.len() as u64,
            1024,
            "entries, one per device",
        )?;
        if self
            .device_weights
            .iter()
            .any(|w| !(w.is_finite() && *w > 0.0))
        {
            return Err(ConfigError::invalid(
                "parallel.device_weights",
                format!("{:?}", self.device_weights),
                "positive numbers, one per device used (or [] for equal shares)",
            ));
        }
        if self.sync_batchnorm {
            return Err(ConfigError::invalid(
                "parallel.sync_batchnorm",
                "true",
                "false: synchronised BatchNorm needs the replicas to exchange batch statistics inside every forward and backward pass, which this Burn version's modules cannot do; each device normalises its own shard (use shards of 32 or more images per device)",
            ));
        }
        Ok(())
    }
}
