//! Measuring each layer's cost for the partition planner: forward + backward time of one
//! micro-batch with its share of the optimizer step, and the bytes the layer would cost its node. Layers are built and timed one at a
//! time, so the profiler never holds the whole model (the point of model parallelism is that it
//! may not fit).

use std::time::{Duration, Instant};

use ringtmp_model::{Layer, Optimizer, OptimizerConfig, Pass, Stage};

use crate::plan::partition::LayerCost;

/// How many micro-batches a stage holds at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// A set number, whatever the ring's size.
    Fixed(usize),
    /// One per node of the ring and `plus` more (the async schedule's default window): a stage's
    /// memory then follows the size of the ring the planner chooses, not the nodes given.
    PerNode {
        /// Micro-batches beyond one per node.
        plus: usize,
    },
    /// 1F1B's: one more than the stages after the stage's own, at most `micro_batches`
    /// (`partition::in_flight_at`): a ring's first stages hold more than its last.
    OneFOneB {
        /// Micro-batches per mini-batch.
        micro_batches: usize,
    },
}

/// What the profiler must assume about the schedule.
#[derive(Clone, Debug)]
pub struct ProfileSettings {
    /// Rows per micro-batch.
    pub rows: usize,
    /// Compute threads per node.
    pub threads: usize,
    /// Micro-batches whose activations a stage may hold at once.
    pub in_flight: InFlight,
    /// Whether a stage keeps a copy of its parameters for each micro-batch in flight, and two
    /// released copies for reuse (the async schedule's weight stashing, `Stage::step`).
    pub stashes_weights: bool,
    /// Optimizer steps per micro-batch: 1 under async (a step after every backward), `1 / M`
    /// under the flushed schedules.
    pub steps_per_micro_batch: f64,
    /// Timed runs per layer (the lower quartile counts), after one warm-up.
    pub repeats: usize,
}

/// Times every layer's forward + backward on a micro-batch, plus its share of the optimizer
/// step (lower quartile of `repeats` runs after one warm-up), and estimates its memory:
/// parameters, gradients, optimizer state and stashed weight versions, plus stashed activations
/// for the micro-batches in flight.
pub fn profile_layers(
    layers: &[Layer],
    optimizer: &OptimizerConfig,
    settings: &ProfileSettings,
) -> Vec<LayerCost> {
    let ProfileSettings {
        rows,
        threads,
        in_flight,
        stashes_weights,
        steps_per_micro_batch,
        repeats,
    } = *settings;
    let state_copies = ringtmp_contract::memory_floor::state_copies(optimizer);
    time_layers(layers, optimizer, rows, threads, repeats, None)
        .into_iter()
        .zip(layers)
        .map(|(timing, layer)| {
            let params = layer.param_count() as u64 * 4;
            let step = timing.step_seconds * steps_per_micro_batch;
            // Parameters, gradients and optimizer state; with weight stashing, two released
            // versions kept for reuse and one per micro-batch in flight.
            let (held, per_micro_batch) = if stashes_weights {
                (params * (4 + state_copies), params + timing.stash_bytes)
            } else {
                (params * (2 + state_copies), timing.stash_bytes)
            };
            let (bytes, bytes_per_node, stash_per_in_flight, micro_batches) = match in_flight {
                InFlight::Fixed(w) => (held + per_micro_batch * w as u64, 0, 0, 0),
                InFlight::PerNode { plus } => {
                    (held + per_micro_batch * plus as u64, per_micro_batch, 0, 0)
                }
                InFlight::OneFOneB { micro_batches } => (held, 0, per_micro_batch, micro_batches),
            };
            LayerCost {
                seconds: timing.compute_seconds + step,
                after_send_seconds: timing.after_send_seconds + step,
                bytes,
                bytes_per_node,
                out_bytes: (rows * layer.output.numel() * 4) as u64,
                has_params: layer.param_count() > 0,
                stash_per_in_flight,
                micro_batches,
                eval_bytes: timing.eval_bytes,
            }
        })
        .collect()
}

pub use ringtmp_contract::machine::LayerTiming;

/// Most bytes of layers (parameters, gradients, optimizer state, a micro-batch's activations)
/// the profiler holds at once: the layers of a window this size are timed in turns, larger
/// models window by window, so that the profiler never needs the whole model. Never more than an
/// eighth of the memory this process may still use (a board, or a node under
/// `--node-memory-limit`).
const INTERLEAVED_BYTES: usize = 256 << 20;

/// The window's bound here: [`INTERLEAVED_BYTES`], or an eighth of the available memory when
/// that is less.
fn interleaved_bytes() -> usize {
    ringtmp_contract::machine::available_memory().map_or(INTERLEAVED_BYTES, |free| {
        INTERLEAVED_BYTES.min(usize::try_from(free / 8).unwrap_or(usize::MAX))
    })
}

/// Times each layer on micro-batches of `rows`: one warm-up run, then up to `repeats` timed
/// runs, their lower quartile counting. With a `budget`, a layer gets its share of it (by
/// parameter and activation size): its timed runs stop once its share is spent, and a warm-up
/// that alone spent it is the one measurement; a weak board times the model in about the budget
/// (or one pass, if longer).
///
/// The layers take turns — a run of each, then the next run of each — within windows of
/// 256 MB (less on a node with little memory; every preset is one window): a machine that slows down for a while
/// (another tenant, a frequency change) then slows every layer's runs alike, and the plan's
/// balance, which depends only on the layers' relative costs, does not move. Timed one layer
/// after another, a slow second fell on a few layers only: the same model planned 0..9 and
/// 0..10 on consecutive runs (docs/decisions/planner.md).
///
/// A layer at or below the model's first one with parameters is timed without its input
/// gradient: the planner keeps it on the master (raw inputs never leave it), where nothing
/// below it needs one.
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
    let first_param = layers.iter().position(|l| l.param_count() > 0);
    let mut timings = Vec::with_capacity(layers.len());
    for window in windows(layers, rows, interleaved_bytes()) {
        let mut benches: Vec<LayerBench> = window
            .map(|i| {
                let share = budget.map(|b| b.as_secs_f64() * weight(&layers[i]) / total_weight);
                let input_grad = first_param.is_some_and(|f| i > f);
                LayerBench::new(layers, i, optimizer, rows, threads, input_grad, share)
            })
            .collect();
        for rep in 0..=repeats.max(1) {
            let mut any = false;
            for bench in benches.iter_mut().filter(|b| !b.done) {
                bench.run(rep);
                any = true;
            }
            if !any {
                break;
            }
        }
        timings.extend(benches.into_iter().map(LayerBench::timing));
    }
    timings
}

/// Consecutive runs of layers that the profiler holds at once: each as long as its layers'
/// parameters, gradients, two optimizer states and a micro-batch of `rows` activations (in and
/// out, with their gradients) fit in `bound` bytes together, and at least one layer.
fn windows(layers: &[Layer], rows: usize, bound: usize) -> Vec<std::ops::Range<usize>> {
    let held = |l: &Layer| 16 * l.param_count() + 8 * rows * (l.input.numel() + l.output.numel());
    let mut windows = Vec::new();
    let mut start = 0;
    while start < layers.len() {
        let (mut end, mut bytes) = (start + 1, held(&layers[start]));
        while end < layers.len() && bytes + held(&layers[end]) <= bound {
            bytes += held(&layers[end]);
            end += 1;
        }
        windows.push(start..end);
        start = end;
    }
    windows
}

/// One layer under the profiler: its own one-layer stage, inputs and optimizer, and its runs.
struct LayerBench {
    stage: Stage,
    x: Vec<f32>,
    dy: Vec<f32>,
    rows: usize,
    optim: Optimizer,
    /// Its share of the budget, seconds.
    share: Option<f64>,
    /// Seconds its runs took so far, the warm-up included.
    spent: f64,
    times: Vec<f64>,
    step_times: Vec<f64>,
    after_send_times: Vec<f64>,
    stash: usize,
    /// Bytes the evaluation pass held (measured at the warm-up).
    eval_bytes: usize,
    /// No more runs: the share is spent.
    done: bool,
}

impl LayerBench {
    fn new(
        layers: &[Layer],
        i: usize,
        optimizer: &OptimizerConfig,
        rows: usize,
        threads: usize,
        input_grad: bool,
        share: Option<f64>,
    ) -> Self {
        let layer = &layers[i];
        let mut stage = Stage::new(layers, i..i + 1, 0, threads);
        stage.set_input_grad(input_grad);
        let x = layer.sample_input(rows);
        let dy = vec![0.01f32; rows * layer.output.numel()];
        let optim = Optimizer::new(optimizer.clone(), stage.params().len());
        Self {
            stage,
            x,
            dy,
            rows,
            optim,
            share,
            spent: 0.0,
            times: Vec::new(),
            step_times: Vec::new(),
            after_send_times: Vec::new(),
            stash: 0,
            eval_bytes: 0,
            done: false,
        }
    }

    /// Run `rep` (0: the warm-up): forward, backward and the optimizer step.
    fn run(&mut self, rep: usize) {
        if rep > 1 && self.share.is_some_and(|s| self.spent > s) {
            self.done = true;
            return;
        }
        let pass = Pass {
            train: true,
            seed: 0,
            step: 0,
            row_offset: 0,
        };
        let t = Instant::now();
        let _ = self.stage.forward(rep as u64, &self.x, self.rows, &pass);
        self.stash = self.stash.max(self.stage.stash_bytes());
        // Split as a ring stage runs it: the input gradient handed out, then the weight gradient
        // (a layer that makes no input gradient runs whole).
        let mut sent = None;
        let _ = self
            .stage
            .backward_sending(rep as u64, &self.dy, None, &mut || {}, &mut |_| {
                sent = Some(Instant::now())
            });
        let end = Instant::now();
        let compute = (end - t).as_secs_f64();
        // A layer without parameters has nothing after the send but the loop's overhead.
        let after_send = sent
            .filter(|_| !self.stage.params().is_empty())
            .map_or(0.0, |at| (end - at).as_secs_f64());
        if rep == 0 {
            // An evaluation pass's working set, measured once.
            let _ = self.stage.infer(&self.x, self.rows);
            self.eval_bytes = self.stage.eval_bytes();
        }
        let t = Instant::now();
        // A tiny rate: the profile must not blow the parameters up over the repeats.
        self.stage.step(&mut self.optim, 1e-6);
        let step = t.elapsed().as_secs_f64();
        self.spent += compute + step;
        // A warm-up that alone took the layer's share (a weak board) is the measurement: a
        // second pass would double the time for little accuracy.
        let over = rep == 0 && self.share.is_some_and(|s| self.spent > s);
        if rep > 0 || over {
            self.times.push(compute);
            self.step_times.push(step);
            self.after_send_times.push(after_send);
        }
        if over {
            self.done = true;
        }
    }

    fn timing(mut self) -> LayerTiming {
        // The lower quartile: a busy host only ever adds time, and the median of a layer whose
        // runs fell half in a slow stretch and half outside is whichever half it tips to.
        let lower_quartile = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len().saturating_sub(1) / 4).copied().unwrap_or(0.0)
        };
        LayerTiming {
            compute_seconds: lower_quartile(&mut self.times),
            step_seconds: lower_quartile(&mut self.step_times),
            after_send_seconds: lower_quartile(&mut self.after_send_times),
            // The stage input is stashed once per stage, not per layer: count outputs and side
            // data.
            stash_bytes: self.stash.saturating_sub(self.x.len() * 4) as u64,
            eval_bytes: self.eval_bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use ringtmp_model::{ModelSpec, Shape};

    use super::*;

    fn mlp_deep() -> Vec<Layer> {
        ModelSpec::preset("mlp-deep", 10)
            .unwrap()
            .build(&Shape::image(28, 28, 1), 10)
            .unwrap()
    }

    #[test]
    fn a_preset_is_one_window_and_a_tight_bound_windows_every_layer_once() {
        let layers = mlp_deep();
        assert_eq!(
            windows(&layers, 64, INTERLEAVED_BYTES),
            vec![0..layers.len()]
        );
        // A bound below two hidden layers' 16 MB each: each large layer alone, the small ones
        // (activations, the output layer) grouped with their neighbours; every layer in exactly
        // one window, in order.
        let tight = windows(&layers, 64, 20 << 20);
        for w in &tight {
            let large = layers[w.clone()]
                .iter()
                .filter(|l| l.param_count() > 1 << 20)
                .count();
            assert!(large <= 1, "{tight:?}");
        }
        let mut next = 0;
        for w in &tight {
            assert_eq!(w.start, next, "{tight:?}");
            assert!(w.end > w.start, "{tight:?}");
            next = w.end;
        }
        assert_eq!(next, layers.len());
        // A bound below any layer still times each, one at a time.
        assert_eq!(windows(&layers, 64, 1).len(), layers.len());
    }

    #[test]
    fn every_layer_is_timed_once_with_a_budget_and_without() {
        let layers = mlp_deep();
        let sgd = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        };
        for budget in [None, Some(Duration::from_millis(20))] {
            let timings = time_layers(&layers, &sgd, 8, 1, 2, budget);
            assert_eq!(timings.len(), layers.len());
            for (i, (t, l)) in timings.iter().zip(&layers).enumerate() {
                if l.param_count() > 0 {
                    assert!(t.compute_seconds > 0.0 && t.step_seconds > 0.0, "{t:?}");
                }
                // A linear layer that makes its input gradient has a weight gradient after
                // it; the first (layer 1, above the flatten) makes none and runs whole, and a
                // layer without parameters has nothing after it.
                if l.param_count() > 0 && i > 1 {
                    assert!(t.after_send_seconds > 0.0, "layer {i}: {t:?}");
                    assert!(t.after_send_seconds < t.compute_seconds, "layer {i}: {t:?}");
                } else {
                    assert_eq!(t.after_send_seconds, 0.0, "layer {i}: {t:?}");
                }
            }
        }
    }
}
