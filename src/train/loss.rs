//! Cross-entropy with label smoothing, and top-1 correctness, on logits.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

/// Mean cross-entropy over the batch; with smoothing `alpha` the target is
/// `(1 - alpha) * one_hot + alpha / classes`, as `torch.nn.CrossEntropyLoss(label_smoothing=alpha)`.
///
/// `logits`: `[N, K]`, `targets`: `[N]` -> `[1]`
pub fn cross_entropy<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    alpha: f64,
) -> Tensor<B, 1> {
    let [n, k] = logits.dims();
    let logp = log_softmax(logits, 1);
    let picked = logp.clone().gather(1, targets.reshape([n, 1])); // [N, 1]
    let nll = picked.neg().mean();
    if alpha == 0.0 {
        return nll;
    }
    let uniform = logp.sum_dim(1).neg().mean().div_scalar(k as f64);
    nll.mul_scalar(1.0 - alpha) + uniform.mul_scalar(alpha)
}

/// Number of rows whose arg-max is the target. `[N, K]`, `[N]` -> `[1]`
pub fn correct<B: Backend>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1, Int> {
    let n = targets.dims()[0];
    logits.argmax(1).reshape([n]).equal(targets).int().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TestBackend, device};

    #[test]
    fn matches_hand_computed_values() {
        let dev = device();
        let logits = Tensor::<TestBackend, 2>::from_data(
            [
                [2.0, 0.0, 0.0], // target 0: correct
                [0.0, 1.0, 3.0], // target 1: wrong (predicts 2)
            ],
            &dev,
        );
        let targets = Tensor::<TestBackend, 1, Int>::from_data([0, 1], &dev);
        let lse = |r: [f64; 3]| r.iter().map(|v| v.exp()).sum::<f64>().ln();
        let (l0, l1) = (lse([2.0, 0.0, 0.0]), lse([0.0, 1.0, 3.0]));
        let nll = ((l0 - 2.0) + (l1 - 1.0)) / 2.0;
        let got: f64 = cross_entropy(logits.clone(), targets.clone(), 0.0)
            .into_scalar()
            .into();
        assert!((got - nll).abs() < 1e-5, "{got} vs {nll}");

        let uniform = ((3.0 * l0 - 2.0) + (3.0 * l1 - 4.0)) / 2.0 / 3.0;
        let smoothed = 0.9 * nll + 0.1 * uniform;
        let got: f64 = cross_entropy(logits.clone(), targets.clone(), 0.1)
            .into_scalar()
            .into();
        assert!((got - smoothed).abs() < 1e-5, "{got} vs {smoothed}");

        let c: i64 = correct(logits, targets).into_scalar().into();
        assert_eq!(c, 1);
    }
}
