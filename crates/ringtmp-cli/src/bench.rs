//! `ringtmp bench-compute`: training throughput of the compute engine alone (one process, no
//! evaluation, no I/O), per model and thread count, as the median of repeated timed runs.
//!
//! Each configuration runs in its own rayon pool of exactly `threads` threads, so 1- and 2-thread
//! numbers come from the same process and can be compared as ratios.

use std::time::Instant;

use crate::error::UsageError;
use anyhow::{Context, Result};
use clap::Args;
use ringtmp_data::BatchPlan;
use ringtmp_model::{ModelSpec, Optimizer, OptimizerConfig, Pass, Shape, Stage, loss};
use serde_json::json;

/// `ringtmp bench-compute` options.
#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// Models to measure (presets), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "mlp,cnn")]
    pub models: Vec<String>,
    /// Thread counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Examples per step.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Timed steps per repeat.
    #[arg(long, default_value_t = 40)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Timed repeats; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Dataset whose batches are fed.
    #[arg(long, default_value = "mnist")]
    pub dataset: String,
    /// Also time every layer's forward and backward (each layer's optimizer update runs inside
    /// its backward, as in training) in one extra repeat, and print where each step's time goes.
    #[arg(long)]
    pub profile: bool,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// Compares each result with the figures stored in FILE for this machine's kind (its CPU
    /// model name, family and model numbers, and SIMD level), as throughput per GFLOP/s of a reference GEMM timed right before
    /// each repeat, so a machine slower today than on the day they were stored does not read as
    /// a regression; fails when one is below `1 − --tolerance` of its stored figure.
    #[arg(long, value_name = "FILE")]
    pub baseline: Option<std::path::PathBuf>,
    /// Stores this run's figures in FILE as the baseline of this machine's kind (replacing the
    /// kind's previous ones, keeping the other kinds').
    #[arg(long, value_name = "FILE")]
    pub save_baseline: Option<std::path::PathBuf>,
    /// Largest shortfall against the baseline that is not a regression.
    #[arg(long, default_value_t = 0.15)]
    pub tolerance: f64,
}

/// One machine kind's stored figures (`--save-baseline`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct KindBaseline {
    /// `kernels::simd_level()` of the machine they were measured on.
    simd: String,
    /// Its CPU model name.
    machine: String,
    /// Its reference GEMM then, GFLOP/s.
    reference_gflops: f64,
    /// (model, threads, batch) → samples/s per reference GFLOP/s.
    results: Vec<BaselineEntry>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct BaselineEntry {
    model: String,
    threads: usize,
    batch_size: usize,
    samples_per_second: f64,
    per_reference_gflop: f64,
}

fn read_baselines(path: &std::path::Path) -> Result<Vec<KindBaseline>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a baseline file", path.display()))
}

/// A machine kind: its CPU (`machine_name`: model name, family and model numbers) and SIMD
/// level. Two kinds with the same SIMD level (an AVX-512 Xeon and an AVX-512 EPYC, or two EPYC
/// generations that a hypervisor names alike) differ in caches, memory and vector units enough
/// that their figures per reference GFLOP/s differ too, so each keeps its own.
fn same_kind(stored: &KindBaseline, simd: &str, machine: &str) -> bool {
    stored.simd == simd && stored.machine == machine
}

/// Compares `current` with `path`'s figures of the same kind; an error names every regression.
fn check_baseline(
    path: &std::path::Path,
    simd: &str,
    machine: &str,
    current: &[BaselineEntry],
    tolerance: f64,
) -> Result<()> {
    if !path.is_file() {
        // A typo must not read as "nothing stored for this kind" and pass.
        return Err(UsageError(format!(
            "--baseline {}: no such file (--save-baseline {0} writes one)",
            path.display()
        ))
        .into());
    }
    let kinds = read_baselines(path)?;
    let Some(stored) = kinds.iter().find(|k| same_kind(k, simd, machine)) else {
        println!(
            "baseline {}: no figures for this kind ({machine}, {simd}; kinds stored: {}); \
             --save-baseline stores this run's",
            path.display(),
            kinds
                .iter()
                .map(|k| format!("{} ({})", k.machine, k.simd))
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(());
    };
    println!(
        "against {} ({}, {:.1} reference GFLOP/s then):",
        path.display(),
        stored.machine,
        stored.reference_gflops
    );
    let mut regressions = Vec::new();
    for c in current {
        let Some(s) = stored
            .results
            .iter()
            .find(|s| s.model == c.model && s.threads == c.threads && s.batch_size == c.batch_size)
        else {
            continue;
        };
        let ratio = c.per_reference_gflop / s.per_reference_gflop;
        let verdict = if ratio < 1.0 - tolerance {
            regressions.push(format!(
                "{} on {} thread(s): {ratio:.2}×",
                c.model, c.threads
            ));
            "REGRESSION"
        } else {
            "ok"
        };
        println!(
            "  {:<10} {:>2} thread(s): {:.2}× the stored figure per reference GFLOP/s ({:.0} \
             samples/s now, {:.0} then) {verdict}",
            c.model, c.threads, ratio, c.samples_per_second, s.samples_per_second
        );
    }
    if regressions.is_empty() {
        Ok(())
    } else {
        anyhow::bail!(
            "below the baseline by more than {:.0}%: {}",
            tolerance * 100.0,
            regressions.join(", ")
        )
    }
}

/// Prints milliseconds per step for each layer's forward and backward (with its update).
fn print_profile(stage: &Stage, total: f64, steps: usize, threads: usize) {
    let Some(times) = stage.layer_times() else {
        return;
    };
    let ms = |s: f64| s * 1e3 / steps as f64;
    println!("  profile, {threads} thread(s), ms per step (share of the step):");
    let mut accounted = 0.0;
    for (i, (layer, t)) in stage.layers().iter().zip(times).enumerate() {
        accounted += t.forward_seconds + t.backward_seconds;
        if let Some(conv) = stage.fused_into(i) {
            println!(
                "    {:>2} {:<10} {:>14} runs inside layer {conv} (fused)",
                layer.index,
                layer.kind_name(),
                layer.output.to_string(),
            );
            continue;
        }
        println!(
            "    {:>2} {:<10} {:>14} fwd {:>6.3} ({:>4.1}%)  bwd {:>6.3} ({:>4.1}%)",
            layer.index,
            layer.kind_name(),
            layer.output.to_string(),
            ms(t.forward_seconds),
            100.0 * t.forward_seconds / total,
            ms(t.backward_seconds),
            100.0 * t.backward_seconds / total
        );
    }
    let updates: f64 = times.iter().map(|t| t.update_seconds).sum();
    println!(
        "    optimizer updates (inside each layer's backward, as in training; counted there; a \
         linear layer's with its weight gradient, made block by block inside it) {:.3} ({:.1}%)",
        ms(updates),
        100.0 * updates / total
    );
    println!(
        "    rest (batch gathering, loss) {:.3} ({:.1}%); step total {:.3}",
        ms(total - accounted),
        100.0 * (total - accounted) / total,
        ms(total)
    );
}

/// Runs the benchmark and prints one line per (model, threads).
#[expect(
    clippy::too_many_lines,
    reason = "the benchmark's sequence of measurements, printed in the order they run"
)]
pub fn run(args: &BenchArgs) -> Result<()> {
    let data = ringtmp_data::load(&args.dataset, None)?;
    let (h, w, c) = data.input;
    let mut results = Vec::new();
    let simd = ringtmp_model::kernels::simd_level();
    let machine = ringtmp_strategy::simulate::machine_name();
    let reference = ringtmp_model::kernels::reference_gflops();
    let capped = if ringtmp_model::kernels::simd_capped_by_build() {
        " (capped: this CPU has AVX-512, the binary was built without the avx512 feature)"
    } else {
        ""
    };
    println!(
        "machine: {machine}; SIMD: {simd}{capped} (element-wise and pooling kernels); GEMM: {}; \
         reference 256³ GEMM on one thread: {reference:.1} GFLOP/s",
        ringtmp_model::kernels::gemm_kernel()
    );
    let mut entries = Vec::new();
    let mut all_references = Vec::new();
    println!(
        "{:<10} {:>7} {:>6} {:>14} {:>14}",
        "model", "threads", "batch", "samples/s", "(min..max)"
    );
    for model in &args.models {
        let spec = ModelSpec::preset(model, data.classes)?;
        let layers = spec.build(&Shape::image(h, w, c), data.classes)?;
        for &threads in &args.threads {
            ringtmp_model::kernels::flush_denormals();
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .start_handler(|_| ringtmp_model::kernels::flush_denormals())
                .build()
                .context("thread pool")?;
            let mut references = Vec::new();
            let rates = pool.install(|| -> Result<Vec<f64>> {
                let mut stage = Stage::new(&layers, 0..layers.len(), 1, threads);
                let mut opt = Optimizer::new(
                    OptimizerConfig::Sgd {
                        momentum: 0.9,
                        weight_decay: 0.0,
                    },
                    stage.params().len(),
                );
                let mut plan = BatchPlan::new(data.train.len(), args.batch_size, 1)?;
                let batches = plan.batches_per_epoch();
                let (mut x, mut y, mut d) = (Vec::new(), Vec::new(), Vec::new());
                let mut step = 0u64;
                let mut one_step = |stage: &mut Stage, step: u64| -> Result<()> {
                    data.train
                        .gather(plan.batch(0, step as usize % batches), &mut x, &mut y);
                    let pass = Pass {
                        train: true,
                        seed: 1,
                        step,
                        row_offset: 0,
                    };
                    let logits = stage.forward(0, &x, y.len(), &pass)?;
                    d.resize(logits.len(), 0.0);
                    loss::softmax_cross_entropy(
                        logits,
                        &y,
                        data.classes,
                        1.0 / y.len() as f32,
                        &mut d,
                    )?;
                    // As training does: each layer updated right after its backward.
                    stage.backward_and_step(0, &d, &mut opt, 0.01, &mut || {})?;
                    Ok(())
                };
                for _ in 0..args.warmup {
                    one_step(&mut stage, step)?;
                    step += 1;
                }
                let mut rates = Vec::new();
                for _ in 0..args.repeats {
                    // The yardstick right before each repeat: on a shared machine whose speed
                    // drifts within seconds, one taken at the start (a few ms) can be 2× off
                    // from the speed a repeat ran at later (seen on the Xeon kind: docs/benchmarks/logs/log-13.md).
                    references.push(ringtmp_model::kernels::reference_gflops_of(15));
                    let t = Instant::now();
                    for _ in 0..args.steps {
                        one_step(&mut stage, step)?;
                        step += 1;
                    }
                    rates.push((args.steps * args.batch_size) as f64 / t.elapsed().as_secs_f64());
                }
                if args.profile {
                    stage.set_profiling(true);
                    let t = Instant::now();
                    for _ in 0..args.steps {
                        one_step(&mut stage, step)?;
                        step += 1;
                    }
                    let total = t.elapsed().as_secs_f64();
                    print_profile(&stage, total, args.steps, threads);
                }
                Ok(rates)
            })?;
            let mut sorted = rates.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            // Each repeat against the yardstick taken next to it, then the median.
            let mut per_reference: Vec<f64> =
                rates.iter().zip(&references).map(|(r, g)| r / g).collect();
            per_reference.sort_by(f64::total_cmp);
            let per_reference_gflop = per_reference[per_reference.len() / 2];
            all_references.extend_from_slice(&references);
            println!(
                "{model:<10} {threads:>7} {:>6} {median:>14.0} {:>7.0}..{:<7.0}",
                args.batch_size,
                sorted[0],
                sorted[sorted.len() - 1]
            );
            results.push(
                json!({"model": model, "threads": threads, "batch_size": args.batch_size,
                "steps": args.steps, "repeats": args.repeats, "samples_per_second_median": median,
                "samples_per_second_runs": rates, "simd": simd, "machine": machine,
                "reference_gflops": reference}),
            );
            entries.push(BaselineEntry {
                model: model.clone(),
                threads,
                batch_size: args.batch_size,
                samples_per_second: median,
                per_reference_gflop,
            });
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    // The yardstick over the whole run (what a stored baseline records).
    all_references.sort_by(f64::total_cmp);
    let reference = all_references
        .get(all_references.len() / 2)
        .copied()
        .unwrap_or(reference);
    if let Some(path) = &args.save_baseline {
        let mut kinds = read_baselines(path)?;
        kinds.retain(|k| !same_kind(k, simd, &machine));
        kinds.push(KindBaseline {
            simd: simd.to_string(),
            machine: machine.clone(),
            reference_gflops: reference,
            results: entries.clone(),
        });
        kinds.sort_by(|a, b| (&a.simd, &a.machine).cmp(&(&b.simd, &b.machine)));
        std::fs::write(path, serde_json::to_string_pretty(&kinds)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!(
            "baseline for this kind ({machine}, {simd}) written to {}",
            path.display()
        );
    }
    if let Some(path) = &args.baseline {
        check_baseline(path, simd, &machine, &entries, args.tolerance)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(model: &str, per_reference_gflop: f64) -> BaselineEntry {
        BaselineEntry {
            model: model.into(),
            threads: 1,
            batch_size: 64,
            samples_per_second: per_reference_gflop * 50.0,
            per_reference_gflop,
        }
    }

    #[test]
    fn a_baseline_is_compared_per_kind_and_names_each_regression() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baseline.json");
        let stored = vec![KindBaseline {
            simd: "avx512".into(),
            machine: "test".into(),
            reference_gflops: 50.0,
            results: vec![entry("mlp", 100.0), entry("cnn", 10.0)],
        }];
        std::fs::write(&path, serde_json::to_string(&stored).unwrap()).unwrap();
        // 10% and 5% below: within 15%.
        assert!(
            check_baseline(
                &path,
                "avx512",
                "test",
                &[entry("mlp", 90.0), entry("cnn", 9.5)],
                0.15
            )
            .is_ok()
        );
        // The cnn 20% below: a regression, named.
        let err = check_baseline(
            &path,
            "avx512",
            "test",
            &[entry("mlp", 99.0), entry("cnn", 8.0)],
            0.15,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("cnn") && !err.contains("mlp"), "{err}");
        // Another kind's figures are never compared: another SIMD level, or another CPU model
        // at the same level.
        assert!(check_baseline(&path, "avx2+fma", "test", &[entry("cnn", 1.0)], 0.15).is_ok());
        assert!(check_baseline(&path, "avx512", "other", &[entry("cnn", 1.0)], 0.15).is_ok());
        // A file that is not there is an error naming it, not a pass.
        let missing = dir.path().join("typo.json");
        let err = check_baseline(&missing, "avx512", "test", &[entry("cnn", 1.0)], 0.15)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("typo.json") && err.contains("no such file"),
            "{err}"
        );
    }
}
