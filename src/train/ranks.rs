//! The multi-process learner's exchanges, on Burn's tensors: rank 0's weights to every
//! rank at the start, every step's gradients summed over the ranks (each rank's loss
//! was weighted by its shard's share of the global batch, so the sum is the gradient
//! of the global batch's mean loss, as with the single-process learner), BatchNorm's
//! running statistics averaged before evaluations and checkpoints, and metric sums.
//! Everything crosses through host memory, as the single-process learner's `ddp` does;
//! the sockets and the order of the sums are `dist`'s.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use super::transfer::{self, Buckets, HostGrads, Part};
use crate::dist::{DistError, Group, Member};

/// Flag bit of a step's gradient sum: this rank was asked to stop (SIGINT/SIGTERM).
const STOP: u32 = 1;

pub struct Ranks {
    group: Group,
    buckets: Buckets,
}

impl Ranks {
    pub fn new(group: Group, buckets: Buckets) -> Self {
        Ranks { group, buckets }
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    pub fn members(&self) -> &[Member] {
        self.group.members()
    }

    pub fn set_timeout(&mut self, timeout: std::time::Duration) {
        self.group.set_timeout(timeout);
    }

    /// `model` with rank 0's trainable parameters and BatchNorm statistics, on every
    /// rank: replicas start equal whatever each process's random initialisation gave.
    pub fn share_model<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: M,
        device: &B::Device,
    ) -> Result<M, DistError> {
        if self.size() == 1 {
            return Ok(model);
        }
        let mut trainable = transfer::snapshot(&model, Part::Trainable, self.buckets);
        let mut stats = transfer::buffers(&model, self.buckets);
        self.group
            .broadcast_f32(&mut trainable.slices_mut(), "the start (rank 0's weights)")?;
        self.group
            .broadcast_f32(&mut stats.slices_mut(), "the start (rank 0's statistics)")?;
        if self.group.is_root() {
            return Ok(model);
        }
        let model = transfer::load(model, &trainable, Part::Trainable, device);
        Ok(transfer::load(model, &stats, Part::Buffers, device))
    }

    /// The gradients summed over every rank, and whether any rank asked to stop after
    /// this step (so that all of them stop at the same one).
    pub fn sum_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        grads: GradientsParams,
        model: &M,
        device: &B::Device,
        stop: bool,
        step: u64,
    ) -> Result<(GradientsParams, bool), DistError> {
        // Alone, the sum is the gradients themselves: no trip through host memory.
        if self.size() == 1 {
            return Ok((grads, stop));
        }
        let mut host = HostGrads::read::<B, M>(grads, model, self.buckets);
        let flags = self.group.sum_f32(
            &mut host.slices_mut(),
            if stop { STOP } else { 0 },
            &format!("step {step}"),
        )?;
        Ok((host.into_params::<B, M>(model, device), flags & STOP != 0))
    }

    /// `model` with BatchNorm's running statistics averaged over the ranks. They are an
    /// exponential average, which is linear: the mean of the ranks' averages is the
    /// average of the mean statistics, as `Replicas::sync_buffers` argues.
    pub fn mean_buffers<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: M,
        device: &B::Device,
        step: u64,
    ) -> Result<M, DistError> {
        if self.size() == 1 {
            return Ok(model);
        }
        let mut stats = transfer::buffers(&model, self.buckets);
        let n = self.size() as f32;
        let mut slices = stats.slices_mut();
        self.group.sum_f32(
            &mut slices,
            0,
            &format!("the BatchNorm statistics at step {step}"),
        )?;
        for s in slices {
            s.iter_mut().for_each(|x| *x /= n);
        }
        Ok(transfer::load(model, &stats, Part::Buffers, device))
    }

    /// `(loss × images, correct, images)` summed over the ranks.
    pub fn sum_totals(
        &mut self,
        totals: (f64, f64, usize),
        during: &str,
    ) -> Result<(f64, f64, usize), DistError> {
        let mut v = [totals.0, totals.1, totals.2 as f64];
        self.group.sum_f64(&mut v, during)?;
        Ok((v[0], v[1], v[2].round() as usize))
    }
}
