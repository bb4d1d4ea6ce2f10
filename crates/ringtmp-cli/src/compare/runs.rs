//! The comparison's runs as the report reads them: each finished run (its summary, job and
//! evaluation curve) and each failed one, and the rows they make — a configuration over its
//! repeats, each figure the median with the range.

use std::collections::BTreeMap;
use std::path::Path;

use ringtmp_metrics::Summary;

use super::quality::Quality;
use super::spec::{CompareOptions, RunPlan};

/// A run's summary, if it finished.
pub fn read_summary(dir: &Path) -> Option<Summary> {
    let text = std::fs::read_to_string(dir.join("summary.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// One finished run.
pub(super) struct Finished {
    pub(super) plan: RunPlan,
    pub(super) summary: Summary,
    /// The job the run planned (job.json).
    pub(super) job: Option<ringtmp_strategy::Job>,
    /// (training seconds, samples, test accuracy or validation loss) at every evaluation.
    pub(super) curve: Vec<(f64, f64, f64)>,
    /// A simulated run's useful fraction of time with failures (simulation.json), if studied.
    pub(super) useful_fraction: Option<f64>,
}

impl Finished {
    /// The training traffic of the node that sent the most (evaluation traffic left out, as
    /// the cluster's bytes per sample leave it out: the ring's evaluation passes travel around
    /// the ring and would otherwise count as training bytes).
    pub(super) fn busiest_bytes(&self) -> u64 {
        self.summary
            .per_node
            .iter()
            .map(|n| n.bytes_sent.saturating_sub(n.eval_bytes_sent))
            .max()
            .unwrap_or(0)
    }

    pub(super) fn label(&self) -> String {
        format!("{} ×{}", self.plan.strategy, self.plan.nodes)
    }
}

pub(super) fn curve(dir: &Path, summary: &Summary, quality: &Quality) -> Vec<(f64, f64, f64)> {
    let per_step = summary.samples as f64 / summary.steps.max(1) as f64;
    let Ok(text) = std::fs::read_to_string(dir.join("metrics.jsonl")) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "eval")
        .filter_map(|e| {
            Some((
                e["train_seconds"].as_f64()?,
                e["step"].as_f64()? * per_step,
                e[quality.curve_field()].as_f64()?,
            ))
        })
        .collect()
}

/// The median and the range of `values` (empty: none).
pub(super) fn spread(mut values: Vec<f64>) -> Option<(f64, f64, f64)> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    Some((median, values[0], values[n - 1]))
}

pub(super) fn show(v: Option<(f64, f64, f64)>, digits: usize, scale: f64) -> String {
    match v {
        None => "—".into(),
        Some((m, lo, hi)) if (hi - lo).abs() < 1e-12 => format!("{:.*}", digits, m * scale),
        Some((m, lo, hi)) => format!(
            "{:.*} ({:.*}–{:.*})",
            digits,
            m * scale,
            digits,
            lo * scale,
            digits,
            hi * scale
        ),
    }
}

/// One row of the comparison: a configuration over its repeats.
pub(super) struct Row {
    pub(super) label: String,
    pub(super) strategy: String,
    pub(super) nodes: u32,
    pub(super) repeats: usize,
    /// Test accuracy or validation loss ([`Quality`]).
    pub(super) final_quality: Option<(f64, f64, f64)>,
    pub(super) best_quality: Option<(f64, f64, f64)>,
    pub(super) time_to_target: Option<(f64, f64, f64)>,
    pub(super) reached: usize,
    /// Samples, or a language model's tokens ([`Quality::unit`]), per second.
    pub(super) samples_per_second: Option<(f64, f64, f64)>,
    /// Per sample or token, like `samples_per_second`.
    pub(super) bytes_per_sample: Option<(f64, f64, f64)>,
    pub(super) busiest_bytes_per_sample: Option<(f64, f64, f64)>,
    pub(super) peak_rss_mb: Option<(f64, f64, f64)>,
    pub(super) idle_fraction: Option<(f64, f64, f64)>,
    pub(super) train_seconds: Option<(f64, f64, f64)>,
    /// With failures (simulated): the useful fraction of time, and samples/s times it.
    pub(super) useful_fraction: Option<(f64, f64, f64)>,
    pub(super) effective_samples_per_second: Option<(f64, f64, f64)>,
    /// Regressions: the final RMSE and MAE in the targets' units.
    pub(super) rmse: Option<(f64, f64, f64)>,
    pub(super) mae: Option<(f64, f64, f64)>,
}

pub(super) fn rows(finished: &[Finished], quality: &Quality) -> Vec<Row> {
    let unit = quality.per_sample();
    let mut groups: BTreeMap<(u32, usize), Vec<&Finished>> = BTreeMap::new();
    let order: Vec<String> = {
        let mut seen = Vec::new();
        for f in finished {
            if !seen.contains(&f.plan.strategy) {
                seen.push(f.plan.strategy.clone());
            }
        }
        seen
    };
    for f in finished {
        let k = order
            .iter()
            .position(|s| *s == f.plan.strategy)
            .unwrap_or(0);
        groups.entry((f.plan.nodes, k)).or_default().push(f);
    }
    groups
        .into_values()
        .map(|g| {
            let of = |f: &dyn Fn(&Finished) -> f64| spread(g.iter().map(|r| f(r)).collect());
            Row {
                label: g[0].label(),
                strategy: g[0].plan.strategy.clone(),
                nodes: g[0].plan.nodes,
                repeats: g.len(),
                final_quality: of(&|r| quality.final_value(&r.summary)),
                best_quality: of(&|r| quality.best_value(&r.summary)),
                time_to_target: spread(
                    g.iter()
                        .filter_map(|r| quality.time_to_target(&r.summary, &r.curve))
                        .collect(),
                ),
                reached: g
                    .iter()
                    .filter(|r| quality.time_to_target(&r.summary, &r.curve).is_some())
                    .count(),
                samples_per_second: of(&|r| r.summary.samples_per_second * unit),
                train_seconds: of(&|r| r.summary.train_seconds),
                useful_fraction: spread(g.iter().filter_map(|r| r.useful_fraction).collect()),
                rmse: spread(
                    g.iter()
                        .filter_map(|r| r.summary.regression.as_ref().map(|e| e.final_test_rmse))
                        .collect(),
                ),
                mae: spread(
                    g.iter()
                        .filter_map(|r| r.summary.regression.as_ref().map(|e| e.final_test_mae))
                        .collect(),
                ),
                effective_samples_per_second: spread(
                    g.iter()
                        .filter_map(|r| {
                            r.useful_fraction
                                .map(|u| u * r.summary.samples_per_second * unit)
                        })
                        .collect(),
                ),
                bytes_per_sample: of(&|r| r.summary.bytes_per_sample / unit),
                busiest_bytes_per_sample: of(&|r| {
                    r.busiest_bytes() as f64 / r.summary.samples.max(1) as f64 / unit
                }),
                peak_rss_mb: of(&|r| {
                    r.summary
                        .per_node
                        .iter()
                        .map(|n| n.peak_rss_bytes)
                        .max()
                        .unwrap_or(0) as f64
                        / 1e6
                }),
                // Of the training time (evaluations left out): the nodes' time not spent
                // computing, waiting for links or for each other.
                idle_fraction: of(&|r| {
                    let compute: f64 = r.summary.per_node.iter().map(|n| n.compute_seconds).sum();
                    let nodes = r.summary.per_node.len().max(1) as f64;
                    (1.0 - compute / (nodes * r.summary.train_seconds).max(1e-12)).max(0.0)
                }),
            }
        })
        .collect()
}

/// The `ringtmp train` arguments run `f` had: its plan's, and under `--train-seconds` the sample
/// budget its probe gave it (its summary's).
pub(super) fn run_args(options: &CompareOptions, f: &Finished) -> Vec<String> {
    let mut args = f.plan.args.clone();
    if let (Some(_), Some(samples)) = (options.train_seconds, f.summary.train_samples) {
        args.extend(["--train-samples".into(), samples.to_string()]);
    }
    args
}

/// A run that ran and left no summary: its label and why, from the last error its log holds.
pub struct Failed {
    /// `strategy ×nodes`, as the table's rows.
    pub label: String,
    /// Its directory name under `runs/`.
    pub name: String,
    /// The error it ended with.
    pub reason: String,
}

/// Why the run logged in `log` failed: its last `error:` line (a node's own error lines are
/// prefixed `[node N]`), else that it left no summary.
pub(super) fn failure_reason(log: &str) -> String {
    log.lines()
        .rev()
        .find_map(|l| {
            let l = l.trim();
            l.strip_prefix("error: ")
                .or_else(|| l.split_once("] error: ").map(|(_, e)| e))
        })
        .map_or_else(
            || "it ended without a summary".to_string(),
            |e| e.trim().to_string(),
        )
}
