//! The run summary (`summary.json`) and the event log (`metrics.jsonl`).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Most step records a node sends in its end-of-run report ([`NodeSummary::steps`]): every
/// k-th step and the last, so that a report stays well inside a control frame.
pub const MAX_REPORTED_STEPS: u64 = 512;

/// Per-node measurements.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// Rank of the node.
    pub rank: u32,
    /// What the node did (`local`, `master`, `stage`, `server`, `worker`).
    pub role: String,
    /// Parameters held by the node.
    pub params: u64,
    /// Bytes of those parameters.
    pub param_bytes: u64,
    /// Bytes of optimizer state held by the node.
    pub optimizer_bytes: u64,
    /// Peak resident set size of the node's process.
    pub peak_rss_bytes: u64,
    /// Bytes sent to other nodes (everything: training, evaluation, heartbeats, control).
    pub bytes_sent: u64,
    /// Of `bytes_sent`, the frames of evaluation passes.
    #[serde(default)]
    pub eval_bytes_sent: u64,
    /// Bytes received from other nodes.
    pub bytes_received: u64,
    /// Messages sent to other nodes.
    pub messages_sent: u64,
    /// Seconds spent in forward, backward and optimizer work.
    pub compute_seconds: f64,
    /// Training seconds not spent computing (waiting, data loading, communication).
    pub idle_seconds: f64,
    /// CPU seconds (user + system) of the node's process.
    pub cpu_seconds: f64,
    /// Seconds the kernel held the node's process off the CPU for its CPU quota (`--node-cpu`;
    /// cgroup `cpu.stat`); absent where the node had no quota. Its compute and waits include them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttled_seconds: Option<f64>,
    /// Seconds the hypervisor gave the cores of a pinned node (`--pin`, or `local` under
    /// `taskset`) to other guests during its run (`/proc/stat`'s steal); absent for a node that
    /// may run on every core. Its compute and waits include them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steal_seconds: Option<f64>,
    /// `idle_seconds / train_seconds` of this node: its share of pipeline bubbles and waiting.
    #[serde(default)]
    pub bubble_fraction: f64,
    /// Most bytes of stashed activations held at once (pipeline strategies).
    #[serde(default)]
    pub peak_stash_bytes: u64,
    /// Layers `[start, end)` this node holds (pipeline strategies), in the model's indices: a
    /// layer the ring cut inside (its head on one node, its tail on the next) is in both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<(usize, usize)>,
    /// Data-parallel workers: iterations completed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iterations: u64,
    /// DiLoCo workers: the examples of the shares this worker trained on (its skipped steps'
    /// are not); the run's `samples` is their sum. 0 where rank 0 counts the run's samples.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub samples: u64,
    /// Seconds blocked waiting: data-parallel workers for parameters (gates and links); ring
    /// nodes for any message (the sum of the two below and of the waits for anything else).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub wait_seconds: f64,
    /// Ring nodes: of `wait_seconds`, the waits that ended with an activation (a non-master's
    /// input; the master's: the last node's output coming back to the loss).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub wait_activation_seconds: f64,
    /// Ring nodes: of `wait_seconds`, the waits that ended with a gradient from the successor.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub wait_gradient_seconds: f64,
    /// Parameter servers: how many iteration starts saw each staleness (index = global iterations
    /// between the unit started and the oldest unit still in progress; under BSP, iterations the
    /// worker was ahead of the slowest). On a server: all workers' starts it gated; on a worker:
    /// its own starts, as server 0 saw them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub staleness_histogram: Vec<u64>,
    /// Parameter servers under ASP, SSP and DSSP, on a server: how many applied pushes had each
    /// update staleness (index = pushes this server applied between sending the worker the
    /// parameters it computed from and applying its gradient; the last index also counts larger
    /// ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub update_staleness_histogram: Vec<u64>,
    /// Parameter servers: workers dropped after dying.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped_workers: Vec<u32>,
    /// Evaluations this node made: `(iteration, test accuracy, test loss, training seconds)`.
    /// The figures are written with ten significant digits in a fixed width
    /// (`fixed_width`): a report's length must not depend on the values in it, or a
    /// simulated run's time would (a sizes-only run evaluates other values than a computing one).
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "fixed_width")]
    pub evaluations: Vec<(u64, f64, f64, f64)>,
    /// Regression: the root mean squared and mean absolute errors of each of `evaluations`, in
    /// order, two figures each (fixed width too).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        with = "fixed_width::values"
    )]
    pub evaluation_errors: Vec<f64>,
    /// Steps this node recorded for the run's log, `(steps done, training loss, learning rate,
    /// training seconds)`: the parameter server's worker 0 sends them to server 0 in its report
    /// (at most [`MAX_REPORTED_STEPS`] a run). Not kept in summary.json.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<(u64, f64, f32, f64)>,
    /// Test accuracy of this node's final replica, when it evaluated one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_accuracy: Option<f64>,
    /// Ring and local: per layer this node trains, `(layer index in the model, seconds of its
    /// training forward passes, seconds of its backward passes with its update where the step
    /// runs inside them)`, on the wall clock — where the node's compute went, comparable layer by
    /// layer between a ring node and `local`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_seconds: Vec<(usize, f64, f64)>,
    /// Per-link traffic: `(peer rank, bytes sent, bytes received)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<(u32, u64, u64)>,
    /// Data-parallel workers: the sum of the mean losses of the units of the final epoch this
    /// node computed (with `final_epoch_units`, the run's `final_train_loss`).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub final_epoch_loss_sum: f64,
    /// Data-parallel workers: units of work of the final epoch this node computed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub final_epoch_units: u64,
}

/// A node that left a run that went on without it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DroppedNode {
    /// Its rank.
    pub rank: u32,
    /// Optimizer steps (global iterations) completed when it was dropped.
    pub step: u64,
    /// Why: the failure that was observed.
    pub reason: String,
}

/// An automatic restart (`--max-restarts`): a node failed, the launcher stopped the others and
/// started the run again from the newest checkpoint that verified.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Restart {
    /// The node whose failure caused it.
    pub rank: u32,
    /// What it failed with.
    pub reason: String,
    /// The last step recorded before the failure.
    pub failed_at_step: u64,
    /// The checkpoint's step the run went on from (0: no checkpoint; it started over).
    pub resumed_from_step: u64,
    /// Steps trained again: `failed_at_step − resumed_from_step`.
    pub steps_redone: u64,
    /// Nodes the run went on with (fewer than before under `--shrink-on-failure`).
    pub nodes: u32,
    /// Wall seconds of training thrown away: from the checkpoint's writing (or the attempt's
    /// start) to the failure.
    pub work_lost_seconds: f64,
    /// Wall seconds without training: from the failure until the restarted run trained again
    /// (stopping the others, planning, starting, rendezvous, reading the checkpoint).
    pub downtime_seconds: f64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

/// Everything a run reports; the contract of DESIGN.md §6.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Strategy (`local`, `ring`, `ps`, …).
    pub strategy: String,
    /// Pipeline schedule (ring only).
    pub schedule: Option<String>,
    /// Consistency model (parameter server only).
    pub consistency: Option<String>,
    /// Number of nodes.
    pub nodes: u32,
    /// Model name.
    pub model: String,
    /// Parameters in the whole model.
    pub model_params: u64,
    /// Dataset name.
    pub dataset: String,
    /// Epochs requested.
    pub epochs: u32,
    /// Examples requested in all, when given instead of the epochs (`--train-samples`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_samples: Option<u64>,
    /// Mini-batch size (examples per optimizer step).
    pub batch_size: u32,
    /// Micro-batches per mini-batch.
    pub micro_batches: u32,
    /// Run seed.
    pub seed: u64,
    /// Optimizer (`sgd` or `adam`).
    pub optimizer: String,
    /// Base learning rate.
    pub lr: f32,
    /// Compute threads per node.
    pub threads: u32,
    /// Optimizer steps completed.
    pub steps: u64,
    /// Training examples processed.
    pub samples: u64,
    /// Mean training loss over the last epoch (or part of it).
    pub final_train_loss: f64,
    /// Test accuracy at the end.
    pub final_test_accuracy: f64,
    /// Best test accuracy seen at any evaluation.
    pub best_test_accuracy: f64,
    /// Accuracy target for `time_to_target_seconds`.
    pub target_accuracy: f64,
    /// Training seconds (evaluation and checkpointing pause this clock) until an evaluation first
    /// reached the target; `null` when it never did.
    pub time_to_target_seconds: Option<f64>,
    /// Optimizer step at which the target was first reached.
    pub steps_to_target: Option<u64>,
    /// Wall-clock seconds of the whole run, evaluation included.
    pub wall_seconds: f64,
    /// Seconds spent training (the clock behind `samples_per_second`).
    pub train_seconds: f64,
    /// Training examples per training second.
    pub samples_per_second: f64,
    /// Bytes sent by all nodes together.
    pub total_bytes_sent: u64,
    /// Training bytes (`total_bytes_sent` less evaluation frames) per training example.
    pub bytes_per_sample: f64,
    /// For gpipe/1f1b: the ideal bubble fraction `(N − 1)/(M + N − 1)`, to compare with each
    /// node's measured `bubble_fraction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub theoretical_bubble_fraction: Option<f64>,
    /// The partition plan (pipeline strategies): per stage its layers and predicted cost.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partition: Vec<serde_json::Value>,
    /// Decentralised strategies: mean over workers of ‖x_i − x̄‖ / ‖x̄‖ at the last consensus
    /// (how far the workers' models are from the model whose accuracy is reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consensus_distance: Option<f64>,
    /// Nodes the run went on without (empty for a run that ended with every node): a degraded
    /// run says so here and in its final lines.
    #[serde(default)]
    pub dropped_nodes: Vec<DroppedNode>,
    /// Automatic restarts along the way (`--max-restarts`), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarts: Vec<Restart>,
    /// Ring with stage replicas: the nodes it healed around without a restart, in order (the
    /// same fields as a restart; `nodes` is the ring after the heal).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub heals: Vec<Restart>,
    /// A language model's figures (absent for classifiers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<LanguageSummary>,
    /// A regression's figures (absent for classifiers); `final_test_accuracy` then holds R².
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regression: Option<RegressionSummary>,
    /// Per-node measurements.
    pub per_node: Vec<NodeSummary>,
}

/// A language model's figures: validation loss in nats per token, and what it means.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LanguageSummary {
    /// Positions per window.
    pub seq_len: u32,
    /// Token ids.
    pub vocab: u32,
    /// What a token is: `char` (a character vocabulary) or `token`.
    pub unit: String,
    /// Mean cross-entropy over the fixed validation windows at the last evaluation (nats per
    /// token).
    pub final_val_loss: f64,
    /// The lowest validation loss of any evaluation.
    pub best_val_loss: f64,
    /// `exp(final_val_loss)`.
    pub final_perplexity: f64,
    /// `final_val_loss / ln 2`: bits per character for a character vocabulary.
    pub final_bits_per_unit: f64,
    /// Training tokens (positions) per second: `samples_per_second × seq_len`.
    pub tokens_per_second: f64,
    /// Training FLOPs per token: `6 × parameters` plus the attention's `12 × width × seq_len`
    /// per attention layer (PaLM's accounting, the causal mask not discounted).
    #[serde(default)]
    pub flops_per_token: f64,
    /// `flops_per_token × tokens_per_second / 10⁹`.
    #[serde(default)]
    pub model_gflops: f64,
}

/// A regression's figures on the test split, over every target: the errors in the target's own
/// units (several targets: in standard deviations, the units they are trained in), and R²
/// (scikit-learn's `score`: 1 − MSE / the targets' variance).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RegressionSummary {
    /// The targets' names.
    pub targets: Vec<String>,
    /// The test loss at the last evaluation: the mean squared error of a standardised output.
    pub final_test_loss: f64,
    /// Its square root.
    pub final_test_rmse: f64,
    /// Mean absolute error of an output at the last evaluation.
    pub final_test_mae: f64,
    /// The lowest root mean squared error of any evaluation.
    pub best_test_rmse: f64,
    /// R² at the last evaluation.
    pub final_test_r2: f64,
}

impl LanguageSummary {
    /// Perplexity and bits per unit of a loss in nats.
    pub fn meaning(loss: f64) -> (f64, f64) {
        (loss.exp(), loss / std::f64::consts::LN_2)
    }
}

impl Summary {
    /// Writes the summary as pretty JSON to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }
}

/// An append-only JSON-lines log: one object per event, flushed per line so a crashed run keeps
/// everything up to its last event.
pub struct EventLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventLog {
    /// Creates (truncates) `path`; appends instead when `append` is set (a resumed run).
    pub fn create(path: &Path, append: bool) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    /// Where the log is written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event.
    pub fn write(&mut self, event: &serde_json::Value) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, event).map_err(std::io::Error::other)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_has_every_contract_key() {
        let s = Summary {
            per_node: vec![NodeSummary::default()],
            ..Default::default()
        };
        let v = serde_json::to_value(&s).unwrap();
        for key in [
            "strategy",
            "schedule",
            "consistency",
            "nodes",
            "model",
            "dataset",
            "epochs",
            "batch_size",
            "micro_batches",
            "seed",
            "final_test_accuracy",
            "best_test_accuracy",
            "target_accuracy",
            "time_to_target_seconds",
            "wall_seconds",
            "samples_per_second",
            "total_bytes_sent",
            "bytes_per_sample",
            "per_node",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        for key in [
            "rank",
            "role",
            "params",
            "param_bytes",
            "peak_rss_bytes",
            "bytes_sent",
            "bytes_received",
            "messages_sent",
            "compute_seconds",
            "idle_seconds",
            "cpu_seconds",
        ] {
            assert!(
                v["per_node"][0].get(key).is_some(),
                "missing per_node.{key}"
            );
        }
    }
}

/// Evaluation figures as fixed-width text: `d.ddddddddde±xxx` (16 characters for every
/// non-negative value, `NaN` and `inf` padded to them), so the encoded length of a report does not depend on its values.
pub mod fixed_width {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// `value` in 16 characters (a negative value in 17; a non-finite one right-aligned).
    pub fn format(value: f64) -> String {
        if !value.is_finite() {
            return format!("{value:>16}");
        }
        let text = format!("{value:.9e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:03}", exponent.abs())
    }

    type Evaluation = (u64, f64, f64, f64);

    /// A list of figures, each written as [`format`] writes it.
    pub mod values {
        use serde::{Deserialize, Deserializer, Serialize, Serializer};

        /// Writes each value in fixed width.
        pub fn serialize<S: Serializer>(list: &[f64], s: S) -> Result<S::Ok, S::Error> {
            list.iter()
                .map(|&v| super::format(v))
                .collect::<Vec<_>>()
                .serialize(s)
        }

        /// Reads what [`serialize`] wrote.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
            Vec::<String>::deserialize(d)?
                .iter()
                .map(|t| {
                    t.trim()
                        .parse::<f64>()
                        .map_err(|e| serde::de::Error::custom(format!("figure {t:?}: {e}")))
                })
                .collect()
        }
    }

    /// Writes each evaluation as `[iteration, "accuracy", "loss", "seconds"]`.
    pub fn serialize<S: Serializer>(list: &[Evaluation], s: S) -> Result<S::Ok, S::Error> {
        list.iter()
            .map(|&(i, a, l, t)| (i, format(a), format(l), format(t)))
            .collect::<Vec<_>>()
            .serialize(s)
    }

    /// Reads what [`serialize`] wrote.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Evaluation>, D::Error> {
        let parse = |text: &str| {
            text.trim()
                .parse::<f64>()
                .map_err(|e| serde::de::Error::custom(format!("evaluation figure {text:?}: {e}")))
        };
        Vec::<(u64, String, String, String)>::deserialize(d)?
            .into_iter()
            .map(|(i, a, l, t)| Ok((i, parse(&a)?, parse(&l)?, parse(&t)?)))
            .collect()
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn every_figure_takes_sixteen_characters_and_reads_back() {
            for v in [f64::NAN, f64::INFINITY] {
                let text = super::format(v);
                assert_eq!(text.len(), 16, "{text}");
                assert_eq!(text.trim().parse::<f64>().unwrap().to_bits(), v.to_bits());
            }
            for v in [
                0.0,
                1.0,
                std::f64::consts::LN_10,
                0.0925,
                1e-7,
                12345.678,
                1e120,
            ] {
                let text = super::format(v);
                assert_eq!(text.len(), 16, "{text}");
                let back: f64 = text.parse().unwrap();
                assert!((back - v).abs() <= v.abs() * 1e-9, "{v} → {text} → {back}");
            }
        }
    }
}
