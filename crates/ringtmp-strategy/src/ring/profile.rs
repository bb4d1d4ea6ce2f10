//! Measuring each layer's cost for the partition planner: forward + backward time of one
//! micro-batch, and the bytes the layer would cost its node. Layers are built and timed one at a
//! time, so the profiler never holds the whole model (the point of model parallelism is that it
//! may not fit).

use std::time::Instant;

use ringtmp_model::{Layer, OptimizerConfig, Pass, Stage};

use super::partition::LayerCost;

/// Times every layer on `rows` rows (median of `repeats` runs after one warm-up) and estimates its
/// memory: parameters, gradients and optimizer state, plus stashed activations for `in_flight`
/// micro-batches.
pub fn profile_layers(
    layers: &[Layer],
    rows: usize,
    threads: usize,
    optimizer: &OptimizerConfig,
    in_flight: usize,
    repeats: usize,
) -> Vec<LayerCost> {
    let state_copies = match optimizer {
        OptimizerConfig::Sgd { momentum, .. } if *momentum == 0.0 => 0,
        OptimizerConfig::Sgd { .. } => 1,
        OptimizerConfig::Adam { .. } => 2,
    };
    layers
        .iter()
        .enumerate()
        .map(|(i, layer)| {
            let mut stage = Stage::new(layers, i..i + 1, 0, threads);
            stage.set_input_grad(i > 0);
            let x: Vec<f32> = (0..rows * layer.input.numel())
                .map(|k| ((k * 7919) % 17) as f32 / 17.0 - 0.5)
                .collect();
            let dy = vec![0.01f32; rows * layer.output.numel()];
            let pass = Pass {
                train: true,
                seed: 0,
                step: 0,
                row_offset: 0,
            };
            let mut times = Vec::with_capacity(repeats);
            let mut stash = 0usize;
            for rep in 0..=repeats {
                let t = Instant::now();
                let _ = stage.forward(rep as u64, &x, rows, &pass);
                stash = stash.max(stage.stash_bytes());
                let _ = stage.backward(rep as u64, &dy);
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            let params = layer.param_count() as u64 * 4;
            // The stage input is stashed once per stage, not per layer: count outputs and side data.
            let per_micro = stash.saturating_sub(x.len() * 4) as u64;
            LayerCost {
                seconds: times.get(times.len() / 2).copied().unwrap_or(0.0),
                bytes: params * (2 + state_copies) + per_micro * in_flight as u64,
            }
        })
        .collect()
}
