//! Measuring each layer's cost for the partition planner: forward + backward time of one
//! micro-batch with its share of the optimizer step, and the bytes the layer would cost its node. Layers are built and timed one at a
//! time, so the profiler never holds the whole model (the point of model parallelism is that it
//! may not fit).

use std::time::Instant;

use ringtmp_model::{Layer, Optimizer, OptimizerConfig, Pass, Stage};

use super::partition::LayerCost;

/// What the profiler must assume about the schedule.
#[derive(Clone, Debug)]
pub struct ProfileSettings {
    /// Rows per micro-batch.
    pub rows: usize,
    /// Compute threads per node.
    pub threads: usize,
    /// Micro-batches whose activations a stage may hold at once.
    pub in_flight: usize,
    /// Extra copies of a stage's parameters it may hold: stashed weight versions (async).
    pub extra_weight_versions: usize,
    /// Optimizer steps per micro-batch: 1 under async (a step after every backward), `1 / M`
    /// under the flushed schedules.
    pub steps_per_micro_batch: f64,
    /// Timed runs per layer (the median counts), after one warm-up.
    pub repeats: usize,
}

/// Times every layer's forward + backward on a micro-batch, plus its share of the optimizer
/// step (median of `repeats` runs after one warm-up), and estimates its memory: parameters,
/// gradients, optimizer state and stashed weight versions, plus stashed activations for the
/// micro-batches in flight.
pub fn profile_layers(
    layers: &[Layer],
    optimizer: &OptimizerConfig,
    settings: &ProfileSettings,
) -> Vec<LayerCost> {
    let ProfileSettings {
        rows,
        threads,
        in_flight,
        extra_weight_versions,
        steps_per_micro_batch,
        repeats,
    } = *settings;
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
            let mut optim = Optimizer::new(optimizer.clone(), stage.params().len());
            let (mut times, mut step_times) =
                (Vec::with_capacity(repeats), Vec::with_capacity(repeats));
            let mut stash = 0usize;
            for rep in 0..=repeats {
                let t = Instant::now();
                let _ = stage.forward(rep as u64, &x, rows, &pass);
                stash = stash.max(stage.stash_bytes());
                let _ = stage.backward(rep as u64, &dy);
                let compute = t.elapsed().as_secs_f64();
                let t = Instant::now();
                // A tiny rate: the profile must not blow the parameters up over the repeats.
                stage.step(&mut optim, 1e-6);
                if rep > 0 {
                    times.push(compute);
                    step_times.push(t.elapsed().as_secs_f64());
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            };
            let params = layer.param_count() as u64 * 4;
            // The stage input is stashed once per stage, not per layer: count outputs and side data.
            let per_micro = stash.saturating_sub(x.len() * 4) as u64;
            LayerCost {
                seconds: median(&mut times) + median(&mut step_times) * steps_per_micro_batch,
                bytes: params * (2 + state_copies + extra_weight_versions as u64)
                    + per_micro * in_flight as u64,
                out_bytes: (rows * layer.output.numel() * 4) as u64,
                has_params: layer.param_count() > 0,
            }
        })
        .collect()
}
