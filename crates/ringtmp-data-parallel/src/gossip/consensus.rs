//! The consensus model x̄ the gossip papers evaluate: the mean of the workers' models, and how
//! far the workers are from it.

/// Workers' models by rank.
pub type Models = Vec<(u32, Vec<f32>)>;

/// The mean of the workers' `models` (the consensus model x̄ the papers evaluate) and their
/// consensus distance, mean over workers of ‖x_i − x̄‖ / ‖x̄‖; sums in f64, in the given order.
pub fn consensus(models: &[(u32, Vec<f32>)]) -> (Vec<f32>, f64) {
    let len = models.first().map_or(0, |m| m.1.len());
    let mut sum = vec![0.0f64; len];
    for (_, m) in models {
        sum.iter_mut().zip(m).for_each(|(s, v)| *s += f64::from(*v));
    }
    let k = models.len().max(1) as f64;
    let mean: Vec<f32> = sum.iter().map(|s| (s / k) as f32).collect();
    let norm = mean
        .iter()
        .map(|v| f64::from(*v).powi(2))
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    let distance = models
        .iter()
        .map(|(_, m)| {
            let d: f64 = m
                .iter()
                .zip(&mean)
                .map(|(x, a)| f64::from(x - a).powi(2))
                .sum();
            d.sqrt() / norm
        })
        .sum::<f64>()
        / k;
    (mean, distance)
}

#[cfg(test)]
mod tests {
    #[test]
    fn consensus_is_the_mean_and_the_relative_spread() {
        let (mean, distance) = super::consensus(&[(0, vec![1.0, 0.0]), (1, vec![3.0, 0.0])]);
        assert_eq!(mean, [2.0, 0.0]);
        assert!((distance - 0.5).abs() < 1e-12, "{distance}");
    }
}
