//! How a global batch is shared out among devices: in proportion to their weights,
//! largest remainders first, every share at least one image.

/// Shard sizes for `n` images over devices with relative `weights`. `None` when `n` is
/// smaller than the number of devices.
pub fn shard_sizes(n: usize, weights: &[f64]) -> Option<Vec<usize>> {
    let k = weights.len();
    if k == 0 || n < k {
        return None;
    }
    let total: f64 = weights.iter().sum();
    // One image each first, the rest by weight.
    let rest = (n - k) as f64;
    let ideal: Vec<f64> = weights.iter().map(|w| rest * w / total).collect();
    let mut sizes: Vec<usize> = ideal.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut left = n - sizes.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| {
        (ideal[b] - ideal[b].floor())
            .total_cmp(&(ideal[a] - ideal[a].floor()))
            .then(a.cmp(&b))
    });
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        sizes[i] += 1;
        left -= 1;
    }
    Some(sizes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_sizes_follow_weights_and_never_leave_a_shard_empty() {
        for (n, w, expected) in [
            (256, vec![1.0, 1.0], vec![128, 128]),
            (10, vec![1.0, 1.0, 1.0], vec![4, 3, 3]),
            (3, vec![1.0, 1.0, 1.0], vec![1, 1, 1]),
            (100, vec![3.0, 1.0], vec![75, 25]),
            (4, vec![100.0, 1.0], vec![3, 1]),
            (7, vec![1.0; 8], vec![]),
        ] {
            let got = shard_sizes(n, &w).unwrap_or_default();
            assert_eq!(got, expected, "n={n} w={w:?}");
            if !got.is_empty() {
                assert_eq!(got.iter().sum::<usize>(), n);
                assert!(got.iter().all(|&s| s >= 1));
            }
        }
    }
}
