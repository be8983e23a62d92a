//! `kiln predict`: a run's saved model on new images, BatchNorm in inference mode.

use std::path::PathBuf;

use burn::tensor::activation::softmax;

use super::backend::BackendJob;
use super::error::TrainError;
use super::eval::saved_model;
use super::state::TrainState;
use super::step::to_device;
use crate::data::Loader;
use crate::ops::TrainBackend;

pub struct PredictJob {
    pub checkpoint: PathBuf,
    pub state: TrainState,
    pub loader: Loader,
}

impl BackendJob for PredictJob {
    /// Each image's class probabilities, in the loader's order.
    type Output = Result<Vec<Vec<f32>>, TrainError>;

    fn run<B: TrainBackend>(self, devices: Vec<B::Device>) -> Self::Output {
        let (model, device) = saved_model::<B>(&self.checkpoint, &self.state, devices)?;
        let classes = self.state.spec.num_classes;
        let mut out = Vec::with_capacity(self.loader.num_images());
        for batch in self.loader.epoch(0, 0) {
            let batch = batch?;
            if batch.labels.is_empty() {
                continue;
            }
            let (images, _) = to_device::<B::InnerBackend>(batch, &device);
            let probs = softmax(model.forward(images), 1);
            let values = probs
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("probabilities convert to f32");
            out.extend(values.chunks(classes).map(<[f32]>::to_vec));
        }
        Ok(out)
    }
}

/// The `k` most probable classes of `probs`, most probable first: (class index,
/// probability).
pub fn top_k(probs: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut ranked: Vec<(usize, f32)> = probs.iter().copied().enumerate().collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(k);
    ranked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_ranks_by_probability_and_stops_at_k() {
        let p = [0.1, 0.6, 0.05, 0.25];
        assert_eq!(top_k(&p, 2), vec![(1, 0.6), (3, 0.25)]);
        assert_eq!(top_k(&p, 9).len(), 4);
        assert_eq!(top_k(&[0.5, 0.5], 1), vec![(0, 0.5)]);
    }
}
