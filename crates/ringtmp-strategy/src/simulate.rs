//! `ringtmp simulate`: every strategy's own protocol code on the simulated network, with compute
//! priced by a cost model and tensors carried as sizes (phantom mode), so that clusters far
//! larger than this machine run in seconds to minutes.
//!
//! - [`CostModel`]: per layer, forward and backward seconds per row (and how much of the
//!   backward comes before the input gradient); optimizer seconds per
//!   parameter; element-wise seconds per float. Measured on this machine
//!   ([`CostModel::measure`]) or read from a file measured on another (JSON,
//!   `ringtmp simulate --save-cost-model`).
//! - [`simulate`]: runs a planned [`Job`] on a [`SimNetwork`] whose virtual clocks price the work
//!   each node's kernels record (`ringtmp_meter`) at every point where the strategy accounts for
//!   its compute, and returns the summary the run writes, as `ringtmp train` does.
//!
//! What the simulation assumes (printed with every result by the CLI, see [`ASSUMPTIONS`]):
//! a layer's pass costs its profiled time per row times the rows it runs (the profile is taken
//! at the job's micro-batch), and a ring stage's input gradient leaves once its layers' input
//! gradients are priced, its linear layers' weight gradients after it, as the code runs them; the
//! loss, data loading and bookkeeping cost nothing; encoding or decoding a tensor costs one
//! element-wise pass; each node owns its compute threads (no two
//! simulated nodes share a core), and varies by a seeded ±J (`--compute-jitter`); links are the
//! simulated network's (one egress budget per node shared fairly by its busy links, latency per
//! message, TCP's per-link order), not TCP's congestion control.
//! Accuracy is not simulated: phantom runs compute no values.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ringtmp_data::Dataset;
use ringtmp_meter::Work;
use ringtmp_metrics::Summary;
use ringtmp_model::{Layer, Optimizer, OptimizerConfig, Pass, Stage};
use ringtmp_transport::Transport;
use ringtmp_transport::sim::{ComputeCost, Pricing, SimConfig, SimNetwork};
use serde::{Deserialize, Serialize};

use crate::contract::NodeCx;
use crate::job::Job;
use ringtmp_contract::error::{Error, Result};

/// What a simulation assumes; printed with its results.
pub const ASSUMPTIONS: &str = "compute: each layer pass costs its profiled time per row × rows \
(profiled at the job's micro-batch on the cost model's machine, divided by the node's speed); \
optimizer steps per parameter and tensor encode/decode per value likewise; a ring stage's \
input gradient leaves once its layers' input gradients are priced, and its linear layers' \
weight gradients are priced after it, as they run (a cost model without the input gradients' \
share prices the whole backward before it); the loss, data loading, bookkeeping and evaluations are free (time with --eval-every 0); every node has its \
own cores; each compute takes its price times a seeded factor in [1 − J, 1 + J] \
(--compute-jitter). network: one egress budget per node (--bandwidth-mbit) shared equally by \
the links that have bytes queued (a fluid fair queue), latency per message (--latency-ms), \
per-link FIFO, no TCP congestion control. accuracy: not simulated (tensors carry sizes only)";

/// Per-unit compute costs of one model on one machine (a node of speed 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Where it was measured (`lscpu`'s model name, or what the file says).
    pub machine: String,
    /// The model's name.
    pub model: String,
    /// Rows per pass it was profiled at.
    pub rows: usize,
    /// Compute threads it was profiled with.
    pub threads: usize,
    /// Per layer, forward seconds per row.
    pub forward_seconds_per_row: Vec<f64>,
    /// Per layer, backward seconds per row (input and weight gradients).
    pub backward_seconds_per_row: Vec<f64>,
    /// Per layer, of its backward, the seconds per row until its input gradient is made: a ring
    /// stage sends its input gradient then, and makes a linear layer's weight gradient after it
    /// (the rest of `backward_seconds_per_row`). Empty (cost models written before it was
    /// measured): the whole backward is priced before the send.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub input_grad_seconds_per_row: Vec<f64>,
    /// Optimizer seconds per parameter updated.
    pub update_seconds_per_param: f64,
    /// Seconds per value of an element-wise pass (sum, average, encode, decode).
    pub elementwise_seconds_per_value: f64,
}

impl Pricing for CostModel {
    fn price(&self, work: &Work) -> Duration {
        let layers = |rows: &[u64], per_row: &[f64]| -> f64 {
            rows.iter()
                .zip(per_row)
                .map(|(r, s)| *r as f64 * s)
                .sum::<f64>()
        };
        // A split backward's two parts: the input gradient's share of the layer's backward, and
        // the rest; and a backward that made the rest alone (its input gradient unread). A cost
        // model stored without the shares prices a split backward whole before the send, and a
        // backward alone whole.
        let rows = |r: &[u64], l: usize| r.get(l).copied().unwrap_or(0) as f64;
        let parts = work
            .input_grad_rows
            .len()
            .max(work.weight_grad_rows.len())
            .max(work.weight_grad_alone_rows.len());
        let split: f64 = (0..parts)
            .map(|l| {
                let whole = self.backward_seconds_per_row.get(l).copied().unwrap_or(0.0);
                let (input, rest_alone) = match self.input_grad_seconds_per_row.get(l) {
                    Some(s) => (s.min(whole), whole - s.min(whole)),
                    None => (whole, whole),
                };
                rows(&work.input_grad_rows, l) * input
                    + rows(&work.weight_grad_rows, l) * (whole - input)
                    + rows(&work.weight_grad_alone_rows, l) * rest_alone
            })
            .sum();
        let seconds = layers(&work.forward_rows, &self.forward_seconds_per_row)
            + layers(&work.backward_rows, &self.backward_seconds_per_row)
            + split
            + work.updated_params as f64 * self.update_seconds_per_param
            + work.elementwise as f64 * self.elementwise_seconds_per_value;
        Duration::from_secs_f64(seconds.max(0.0))
    }
}

impl CostModel {
    /// Times every layer's forward and backward on `rows` rows with `threads` threads (median of
    /// `repeats` runs after a warm-up; one layer at a time, so the whole model is never held),
    /// an optimizer step and an element-wise pass.
    pub fn measure(
        model: &str,
        layers: &[Layer],
        optimizer: &OptimizerConfig,
        rows: usize,
        threads: usize,
        repeats: usize,
    ) -> Self {
        let rows = rows.max(1);
        let repeats = repeats.max(1);
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let pass = Pass {
            train: true,
            seed: 0,
            step: 0,
            row_offset: 0,
        };
        let (mut forward, mut backward, mut input_grad) = (Vec::new(), Vec::new(), Vec::new());
        for (i, layer) in layers.iter().enumerate() {
            let mut stage = Stage::new(layers, i..i + 1, 0, threads);
            stage.set_input_grad(i > 0);
            let x = layer.sample_input(rows);
            let dy = vec![0.01f32; rows * layer.output.numel()];
            let (mut f, mut b, mut d) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..=repeats {
                let t = Instant::now();
                let _ = stage.forward(rep as u64, &x, rows, &pass);
                let mid = Instant::now();
                // Split as a ring stage runs it: the input gradient, handed out, then the weight
                // gradient (a layer without one, or the first, which makes no input gradient,
                // runs whole).
                let mut sent = None;
                let _ = stage.backward_sending(rep as u64, &dy, None, &mut || {}, &mut |_| {
                    sent = Some(Instant::now())
                });
                let end = Instant::now();
                if rep > 0 {
                    f.push((mid - t).as_secs_f64());
                    b.push((end - mid).as_secs_f64());
                    d.push((sent.unwrap_or(end) - mid).as_secs_f64());
                }
                stage.zero_grad();
            }
            forward.push(median(f) / rows as f64);
            backward.push(median(b) / rows as f64);
            input_grad.push(median(d) / rows as f64);
        }
        // An update and an element-wise pass over 4 M values: past the caches, as the models'
        // are.
        let n = 1 << 22;
        let mut params = vec![0.5f32; n];
        let grads = vec![0.01f32; n];
        let mut optim = Optimizer::new(optimizer.clone(), n);
        let mut bytes = Vec::with_capacity(n * 4);
        let (mut update, mut elementwise) = (Vec::new(), Vec::new());
        for rep in 0..=repeats {
            let t = Instant::now();
            optim.step(&mut params, &grads, 1e-9, threads);
            let mid = Instant::now();
            bytes.clear();
            ringtmp_wire::message::tensor_bytes_into(&params, ringtmp_wire::Dtype::F32, &mut bytes);
            ringtmp_wire::message::tensor_values_into(
                &bytes,
                ringtmp_wire::Dtype::F32,
                &mut params,
            );
            if rep > 0 {
                update.push((mid - t).as_secs_f64());
                // Two passes: an encode and a decode.
                elementwise.push(mid.elapsed().as_secs_f64() / 2.0);
            }
        }
        Self {
            machine: machine_name(),
            model: model.to_string(),
            rows,
            threads,
            forward_seconds_per_row: forward,
            backward_seconds_per_row: backward,
            input_grad_seconds_per_row: input_grad,
            update_seconds_per_param: median(update) / n as f64,
            elementwise_seconds_per_value: median(elementwise) / n as f64,
        }
    }

    /// Reads a cost model written by [`CostModel::save`].
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cost model {}: {e}", path.display())))?;
        let model: Self = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("cost model {}: {e}", path.display())))?;
        let finite = |v: f64| v.is_finite() && v >= 0.0;
        let layers = model.forward_seconds_per_row.len();
        if model.backward_seconds_per_row.len() != layers
            || (!model.input_grad_seconds_per_row.is_empty()
                && model.input_grad_seconds_per_row.len() != layers)
            || !model
                .forward_seconds_per_row
                .iter()
                .chain(&model.backward_seconds_per_row)
                .chain(&model.input_grad_seconds_per_row)
                .all(|v| finite(*v))
            || !finite(model.update_seconds_per_param)
            || !finite(model.elementwise_seconds_per_value)
        {
            return Err(Error::Config(format!(
                "cost model {}: per-layer costs must be lists of one entry per layer (the \
                 input-gradient costs may be left out), and every cost a finite number ≥ 0",
                path.display()
            )));
        }
        Ok(model)
    }

    /// Writes the cost model as JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("plain data serialises");
        std::fs::write(path, text + "\n")
            .map_err(|e| Error::Config(format!("cost model {}: {e}", path.display())))
    }

    /// Checks that the cost model prices every layer of `layers`.
    pub fn check_fits(&self, model: &str, layers: &[Layer]) -> Result<()> {
        if self.forward_seconds_per_row.len() != layers.len() {
            return Err(Error::Config(format!(
                "the cost model is for {:?} ({} layers), but the model {model:?} has {} layers",
                self.model,
                self.forward_seconds_per_row.len(),
                layers.len()
            )));
        }
        Ok(())
    }

    /// Seconds of one training pass (forward + backward) of `rows` rows through every layer, and
    /// one update of `params` parameters.
    pub fn step_seconds(&self, rows: usize, params: usize) -> f64 {
        let per_row: f64 = self
            .forward_seconds_per_row
            .iter()
            .chain(&self.backward_seconds_per_row)
            .sum();
        per_row * rows as f64 + params as f64 * self.update_seconds_per_param
    }
}

pub use crate::machine::machine_name;
#[cfg(test)]
use crate::machine::machine_name_from_cpuinfo;

/// What a simulation returns.
#[derive(Debug)]
pub struct Simulated {
    /// The summary the run wrote (as `ringtmp train` writes it; accuracy is meaningless in
    /// phantom runs).
    pub summary: Summary,
    /// Virtual time from the start to the last node's end.
    pub virtual_seconds: f64,
    /// Wall time the simulation took on this machine.
    pub wall_seconds: f64,
    /// Messages the simulated network carried.
    pub messages: u64,
    /// The most nodes alive at once (started and not ended: each holds a stack and its
    /// state), the simulation's cost in memory.
    pub most_alive: usize,
    /// Virtual time training started at (0 where no rank announced it).
    pub training_started: f64,
    /// Virtual time of the last step any rank announced (`None` where none did).
    pub training_ended: Option<f64>,
    /// Why each expendable rank that failed did (the run went on without it).
    pub expendable_failures: Vec<String>,
}

/// Runs `job` (planned for `world` nodes) on a simulated network configured by `sim` (links, node speeds, faults; its
/// compute cost and phantom mode as given), every rank a coroutine running the
/// strategy's own code; returns the summary the job's summary-writing rank returned.
pub fn simulate(job: &Job, world: u32, data: &Dataset, sim: SimConfig) -> Result<Simulated> {
    job.validate(world)?;
    let links: Vec<BTreeSet<u32>> = (0..world).map(|r| job.neighbours(r, world)).collect();
    let started = Instant::now();
    let net = SimNetwork::new(sim, links);
    // The virtual times training starts at (the earliest `Started` of any rank) and ends at
    // (the latest `Step`).
    let training_started = std::sync::Mutex::new(f64::INFINITY);
    let training_ended = std::sync::Mutex::new(f64::NEG_INFINITY);
    let results = net
        .try_run(|mut node| {
            let rank = node.rank();
            let clock = node.clock();
            let mut on_event = |event: &crate::Event| {
                let now = clock.now().as_secs_f64();
                match event {
                    crate::Event::Started { .. } => {
                        let mut first = training_started.lock().unwrap_or_else(|e| e.into_inner());
                        *first = first.min(now);
                    }
                    crate::Event::Step { .. } => {
                        let mut last = training_ended.lock().unwrap_or_else(|e| e.into_inner());
                        *last = last.max(now);
                    }
                    _ => {}
                }
            };
            let mut cx = NodeCx {
                net: &mut node,
                data: job.needs_data(rank).then_some(data),
                on_event: &mut on_event,
            };
            let result = job.run(rank, &mut cx);
            match result {
                Ok(summary) => node
                    .close()
                    .map(|()| summary)
                    .map_err(|e| format!("rank {rank}: {e}")),
                Err(e) => {
                    let text = format!("rank {rank}: {e}");
                    node.abort(&text);
                    Err(text)
                }
            }
        })
        .map_err(|e| Error::Config(e.to_string()))?;
    let mut summary = None;
    let mut failures = Vec::new();
    let mut expendable_failures = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(Some(s)) => summary = summary.or(Some(s)),
            Ok(None) => {}
            Err(e) if job.expendable(rank as u32) => expendable_failures.push(e),
            Err(e) => failures.push(e),
        }
    }
    match summary {
        Some(summary) if failures.is_empty() => Ok(Simulated {
            summary,
            virtual_seconds: net.elapsed().as_secs_f64(),
            wall_seconds: started.elapsed().as_secs_f64(),
            messages: net.events(),
            most_alive: net.most_alive(),
            // Strategies that announce no start begin training at once.
            training_started: Some(
                training_started
                    .into_inner()
                    .unwrap_or_else(|e| e.into_inner()),
            )
            .filter(|t| t.is_finite())
            .unwrap_or(0.0),
            training_ended: Some(
                training_ended
                    .into_inner()
                    .unwrap_or_else(|e| e.into_inner()),
            )
            .filter(|t| t.is_finite()),
            expendable_failures,
        }),
        _ => Err(Error::Config(format!(
            "the simulated run failed: {}",
            if failures.is_empty() {
                "no rank wrote a summary".to_string()
            } else {
                failures.join("; ")
            }
        ))),
    }
}

/// A simulated network configuration that prices compute with `costs` and runs in phantom mode.
pub fn priced(seed: u64, costs: CostModel, phantom: bool) -> SimConfig {
    SimConfig {
        compute: ComputeCost::Priced(Arc::new(costs)),
        phantom,
        ..SimConfig::new(seed)
    }
}

#[cfg(test)]
mod tests {
    use super::machine_name_from_cpuinfo;

    #[test]
    fn a_machine_is_named_with_its_cpu_family_and_model() {
        let epyc = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
                    model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\ncpu family\t: 25\n";
        assert_eq!(
            machine_name_from_cpuinfo(epyc),
            "AMD EPYC (family 25 model 17)"
        );
        let arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n";
        assert_eq!(
            machine_name_from_cpuinfo(arm),
            "implementer 0x41 part 0xd0c"
        );
        assert_eq!(
            machine_name_from_cpuinfo("model name : Some CPU\n"),
            "Some CPU"
        );
        assert_eq!(machine_name_from_cpuinfo(""), "unknown");
    }
}
