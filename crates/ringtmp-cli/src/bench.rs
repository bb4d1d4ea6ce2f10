//! `ringtmp bench-compute`: training throughput of the compute engine alone (one process, no
//! evaluation, no I/O), per model and thread count, as the median of repeated timed runs.
//!
//! Each configuration runs in its own rayon pool of exactly `threads` threads, so 1- and 2-thread
//! numbers come from the same process and can be compared as ratios.

use std::time::Instant;

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
    /// Also time every layer's forward and backward and the optimizer step (one extra repeat) and
    /// print where each step's time goes.
    #[arg(long)]
    pub profile: bool,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
}

/// Prints milliseconds per step for each layer's forward and backward and the optimizer.
fn print_profile(stage: &Stage, optimizer_seconds: f64, total: f64, steps: usize, threads: usize) {
    let Some(times) = stage.layer_times() else {
        return;
    };
    let ms = |s: f64| s * 1e3 / steps as f64;
    println!("  profile, {threads} thread(s), ms per step (share of the step):");
    let mut accounted = optimizer_seconds;
    for (layer, t) in stage.layers().iter().zip(times) {
        accounted += t.forward_seconds + t.backward_seconds;
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
    println!(
        "    optimizer step {:.3} ({:.1}%)",
        ms(optimizer_seconds),
        100.0 * optimizer_seconds / total
    );
    println!(
        "    rest (batch gathering, loss) {:.3} ({:.1}%); step total {:.3}",
        ms(total - accounted),
        100.0 * (total - accounted) / total,
        ms(total)
    );
}

/// Runs the benchmark and prints one line per (model, threads).
pub fn run(args: &BenchArgs) -> Result<()> {
    let data = ringtmp_data::load(&args.dataset, None)?;
    let (h, w, c) = data.input;
    let mut results = Vec::new();
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
                let mut optimizer_seconds = 0.0f64;
                let mut one_step =
                    |stage: &mut Stage, step: u64, optimizer_seconds: &mut f64| -> Result<()> {
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
                        stage.backward(0, &d)?;
                        let t = Instant::now();
                        stage.step(&mut opt, 0.01);
                        *optimizer_seconds += t.elapsed().as_secs_f64();
                        Ok(())
                    };
                for _ in 0..args.warmup {
                    one_step(&mut stage, step, &mut optimizer_seconds)?;
                    step += 1;
                }
                let mut rates = Vec::new();
                for _ in 0..args.repeats {
                    let t = Instant::now();
                    for _ in 0..args.steps {
                        one_step(&mut stage, step, &mut optimizer_seconds)?;
                        step += 1;
                    }
                    rates.push((args.steps * args.batch_size) as f64 / t.elapsed().as_secs_f64());
                }
                if args.profile {
                    stage.set_profiling(true);
                    optimizer_seconds = 0.0;
                    let t = Instant::now();
                    for _ in 0..args.steps {
                        one_step(&mut stage, step, &mut optimizer_seconds)?;
                        step += 1;
                    }
                    let total = t.elapsed().as_secs_f64();
                    print_profile(&stage, optimizer_seconds, total, args.steps, threads);
                }
                Ok(rates)
            })?;
            let mut sorted = rates.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            println!(
                "{model:<10} {threads:>7} {:>6} {median:>14.0} {:>7.0}..{:<7.0}",
                args.batch_size,
                sorted[0],
                sorted[sorted.len() - 1]
            );
            results.push(
                json!({"model": model, "threads": threads, "batch_size": args.batch_size,
                "steps": args.steps, "repeats": args.repeats, "samples_per_second_median": median,
                "samples_per_second_runs": rates}),
            );
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
