//! Measuring each layer's cost for the partition planner: forward + backward time of one
//! micro-batch with its share of the optimizer step, and the bytes the layer would cost its node. Layers are built and timed one at a
//! time, so the profiler never holds the whole model (the point of model parallelism is that it
//! may not fit).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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
    time_layers(layers, optimizer, rows, threads, repeats, None)
        .into_iter()
        .zip(layers)
        .map(|(timing, layer)| {
            let params = layer.param_count() as u64 * 4;
            LayerCost {
                seconds: timing.compute_seconds + timing.step_seconds * steps_per_micro_batch,
                bytes: params * (2 + state_copies + extra_weight_versions as u64)
                    + timing.stash_bytes * in_flight as u64,
                out_bytes: (rows * layer.output.numel() * 4) as u64,
                has_params: layer.param_count() > 0,
            }
        })
        .collect()
}

/// One layer's measured times.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerTiming {
    /// Forward + backward of one micro-batch, seconds (median).
    pub compute_seconds: f64,
    /// One optimizer step over the layer's parameters, seconds (median).
    pub step_seconds: f64,
    /// Bytes the layer stashes per micro-batch beyond its input (outputs and side data).
    pub stash_bytes: u64,
}

/// Times each layer alone (built one at a time: the profiler never holds the whole model) on
/// micro-batches of `rows`: one warm-up run, then up to `repeats` timed runs, the median
/// counting. With a `budget`, a layer gets its share of it (by parameter and activation size):
/// timed runs stop once the share is spent, and a warm-up that alone spent it is the one
/// measurement; a weak board times the model in about the budget (or one pass, if longer).
pub fn time_layers(
    layers: &[Layer],
    optimizer: &OptimizerConfig,
    rows: usize,
    threads: usize,
    repeats: usize,
    budget: Option<Duration>,
) -> Vec<LayerTiming> {
    let weight = |l: &Layer| (l.param_count() + rows * (l.input.numel() + l.output.numel())) as f64;
    let total_weight: f64 = layers.iter().map(weight).sum::<f64>().max(1.0);
    layers
        .iter()
        .enumerate()
        .map(|(i, layer)| {
            let share = budget.map(|b| b.as_secs_f64() * weight(layer) / total_weight);
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
            let started = Instant::now();
            for rep in 0..=repeats.max(1) {
                if rep > 1 && share.is_some_and(|s| started.elapsed().as_secs_f64() > s) {
                    break;
                }
                let t = Instant::now();
                let _ = stage.forward(rep as u64, &x, rows, &pass);
                stash = stash.max(stage.stash_bytes());
                let _ = stage.backward(rep as u64, &dy);
                let compute = t.elapsed().as_secs_f64();
                let t = Instant::now();
                // A tiny rate: the profile must not blow the parameters up over the repeats.
                stage.step(&mut optim, 1e-6);
                // A warm-up that alone took the layer's share (a weak board) is the measurement:
                // a second pass would double the time for little accuracy.
                let over = rep == 0 && share.is_some_and(|s| started.elapsed().as_secs_f64() > s);
                if rep > 0 || over {
                    times.push(compute);
                    step_times.push(t.elapsed().as_secs_f64());
                }
                if over {
                    break;
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            };
            LayerTiming {
                compute_seconds: median(&mut times),
                step_seconds: median(&mut step_times),
                // The stage input is stashed once per stage, not per layer: count outputs and
                // side data.
                stash_bytes: stash.saturating_sub(x.len() * 4) as u64,
            }
        })
        .collect()
}
