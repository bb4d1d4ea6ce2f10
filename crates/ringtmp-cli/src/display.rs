//! What a run shows: progress (an indicatif bar on a terminal, periodic plain lines otherwise)
//! and the final summary with its per-node table.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use ringtmp_metrics::Summary;
use ringtmp_strategy::Event;

/// Progress output: an indicatif bar on a terminal, periodic plain lines otherwise.
pub struct Display {
    bar: Option<ProgressBar>,
    total: u64,
    last_line: Instant,
    accuracy: Option<f64>,
    /// A language model's positions per window (`None` for a classifier): its progress shows
    /// tokens per second and validation loss instead of accuracy.
    positions: Option<usize>,
    /// What its tokens are (`character` or `token`), for bits per unit.
    unit: &'static str,
    /// Whether the evaluations are a regression's (R², not an accuracy).
    regression: bool,
    /// When the first step of this run began, and its number: for elapsed time and the ETA.
    started: (Instant, u64),
}

impl Display {
    /// A display for this terminal (or pipe).
    pub fn new() -> Self {
        Self {
            bar: None,
            total: 0,
            last_line: Instant::now(),
            accuracy: None,
            positions: None,
            unit: "token",
            regression: false,
            started: (Instant::now(), 0),
        }
    }

    /// A display for a language model of `positions` per window (`None`: a classifier) whose
    /// vocabulary is `vocabulary` (as the run's spec keeps it).
    pub fn for_language_model(positions: Option<usize>, vocabulary: Option<&str>) -> Self {
        let chars = vocabulary.is_some_and(|v| v.starts_with("chars:"));
        Self {
            positions,
            unit: if chars { "character" } else { "token" },
            ..Self::new()
        }
    }

    /// Shows one progress event.
    pub fn event(&mut self, event: &Event) {
        let tty = std::io::stderr().is_terminal();
        match *event {
            Event::Started {
                total_steps,
                first_step,
                params,
                ref stage_params,
            } => {
                self.total = total_steps;
                self.started = (Instant::now(), first_step);
                let stages = if stage_params.is_empty() {
                    String::new()
                } else {
                    let each: Vec<String> = stage_params
                        .iter()
                        .enumerate()
                        .map(|(rank, p)| format!("node {rank}: {p}"))
                        .collect();
                    format!(" ({})", each.join(", "))
                };
                eprintln!("{params} parameters{stages}; steps {first_step}..{total_steps}");
                if tty {
                    let bar = ProgressBar::new(total_steps).with_position(first_step);
                    bar.set_style(
                        ProgressStyle::with_template(
                            "{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}",
                        )
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    self.bar = Some(bar);
                }
            }
            Event::Step {
                step,
                epoch,
                loss,
                samples_per_second,
            } => {
                let (acc, rate) = match self.positions {
                    Some(positions) => (
                        self.accuracy
                            .map(|l| format!(" val loss {l:.4}"))
                            .unwrap_or_default(),
                        format!("{:.0} tokens/s", samples_per_second * positions as f64),
                    ),
                    None if self.regression => (
                        self.accuracy
                            .map(|r2| format!(" test R² {r2:.4}"))
                            .unwrap_or_default(),
                        format!("{samples_per_second:.0} samples/s"),
                    ),
                    None => (
                        self.accuracy
                            .map(|a| format!(" test acc {:.2}%", a * 100.0))
                            .unwrap_or_default(),
                        format!("{samples_per_second:.0} samples/s"),
                    ),
                };
                if let Some(bar) = &self.bar {
                    bar.set_position(step);
                    bar.set_message(format!("epoch {epoch} loss {loss:.4}{acc} {rate}"));
                } else if self.last_line.elapsed().as_secs_f64() >= 5.0 || step == self.total {
                    self.last_line = Instant::now();
                    eprintln!(
                        "step {step}/{} epoch {epoch} loss {loss:.4}{acc} {rate}; {}",
                        self.total,
                        timing(self.started, step, self.total)
                    );
                }
            }
            Event::Eval {
                step,
                epoch,
                accuracy,
                loss,
                rmse,
                mae,
            } => {
                let line = if let (Some(rmse), Some(mae)) = (rmse, mae) {
                    self.accuracy = Some(accuracy);
                    self.regression = true;
                    format!(
                        "eval step {step} epoch {epoch}: test R² {accuracy:.4}, RMSE {rmse:.4}, \
                         MAE {mae:.4}"
                    )
                } else if self.positions.is_some() {
                    self.accuracy = Some(loss);
                    let (perplexity, bits) = ringtmp_metrics::LanguageSummary::meaning(loss);
                    format!(
                        "eval step {step}: validation loss {loss:.4} (perplexity {perplexity:.2}, \
                         {bits:.3} bits per {}), next-token accuracy {:.2}%",
                        self.unit,
                        accuracy * 100.0
                    )
                } else {
                    self.accuracy = Some(accuracy);
                    format!(
                        "eval step {step} epoch {epoch}: test accuracy {:.2}%, test loss {loss:.4}",
                        accuracy * 100.0
                    )
                };
                match &self.bar {
                    Some(bar) => bar.println(line),
                    None => eprintln!("{line}"),
                }
            }
            Event::Notice { ref text } => match &self.bar {
                Some(bar) => bar.println(text),
                None => eprintln!("{text}"),
            },
            Event::Checkpoint { step, ref path } => {
                let line = format!("checkpoint at step {step}: {}", path.display());
                match &self.bar {
                    Some(bar) => bar.println(line),
                    None => eprintln!("{line}"),
                }
            }
        }
    }

    /// Removes the progress bar.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// `12.3 s elapsed, ETA 45.6 s` after `step` of `total` steps, the run having started at
/// `first` (the ETA at the rate of the steps so far).
fn timing((since, first): (Instant, u64), step: u64, total: u64) -> String {
    let elapsed = since.elapsed().as_secs_f64();
    let done = step.saturating_sub(first);
    if done == 0 || step >= total {
        return format!("{elapsed:.1} s elapsed");
    }
    let eta = elapsed / done as f64 * (total - step) as f64;
    format!("{elapsed:.1} s elapsed, ETA {}", clock(eta))
}

/// Seconds as `45 s`, `12 min 5 s` or `3 h 20 min`.
fn clock(seconds: f64) -> String {
    let s = seconds.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

/// Prints the result of a run and the per-node table.
pub fn print_summary(s: &Summary, out: &std::path::Path) {
    if let Some(lm) = &s.language {
        println!(
            "final validation loss {:.4} (best {:.4}; perplexity {:.2}, {:.3} bits per {}) after \
             {} steps; {:.0} tokens/s; {:.1}s wall",
            lm.final_val_loss,
            lm.best_val_loss,
            lm.final_perplexity,
            lm.final_bits_per_unit,
            if lm.unit == "char" {
                "character"
            } else {
                "token"
            },
            s.steps,
            lm.tokens_per_second,
            s.wall_seconds
        );
        if s.strategy == "local" {
            // This machine's reference GEMM rate (a few milliseconds to measure).
            let reference =
                ringtmp_model::kernels::reference_gflops() * f64::from(s.threads.max(1));
            println!(
                "{:.1} GFLOP/s of model FLOPs ({:.2} MFLOP per token): {:.0}% of the reference \
                 GEMM rate of {reference:.0} GFLOP/s ({} thread(s) × the 256³ product's)",
                lm.model_gflops,
                lm.flops_per_token / 1e6,
                100.0 * lm.model_gflops / reference,
                s.threads
            );
        }
        print_rest(s, out);
        return;
    }
    if let Some(r) = &s.regression {
        let targets = if r.targets.is_empty() {
            String::new()
        } else {
            format!(" of {}", r.targets.join(", "))
        };
        println!(
            "final test RMSE{targets} {:.4} (best {:.4}), MAE {:.4}, R² {:.4} after {} steps; \
             {:.0} samples/s; {:.1}s wall",
            r.final_test_rmse,
            r.best_test_rmse,
            r.final_test_mae,
            r.final_test_r2,
            s.steps,
            s.samples_per_second,
            s.wall_seconds
        );
        match s.time_to_target_seconds {
            Some(t) => println!(
                "reached R² {:.3} after {t:.1}s of training",
                s.target_accuracy
            ),
            None => println!("did not reach R² {:.3}", s.target_accuracy),
        }
        print_rest(s, out);
        return;
    }
    println!(
        "final test accuracy {:.2}% (best {:.2}%) after {} steps; {:.0} samples/s; {:.1}s wall",
        s.final_test_accuracy * 100.0,
        s.best_test_accuracy * 100.0,
        s.steps,
        s.samples_per_second,
        s.wall_seconds
    );
    match s.time_to_target_seconds {
        Some(t) => println!(
            "reached {:.1}% test accuracy after {t:.1}s of training",
            s.target_accuracy * 100.0
        ),
        None => println!(
            "did not reach {:.1}% test accuracy",
            s.target_accuracy * 100.0
        ),
    }
    print_rest(s, out);
}

/// The lines every summary shows after its accuracy or loss: traffic, degradations, the table.
fn print_rest(s: &Summary, out: &std::path::Path) {
    println!(
        "bytes sent {} ({:.1} per sample)",
        s.total_bytes_sent, s.bytes_per_sample
    );
    for d in &s.dropped_nodes {
        println!(
            "WARNING: degraded run: rank {} was dropped at step {} and the run went on without \
             it ({})",
            d.rank, d.step, d.reason
        );
    }
    // Under `--node-cpu`, the seconds each quota held a node off the CPU: its compute and waits
    // include them, so the column says whose wall time a quota stretched.
    let throttling = s.per_node.iter().any(|n| n.throttled_seconds.is_some());
    println!(
        "{:>4} {:<7} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}{}",
        "rank",
        "role",
        "params",
        "peak RSS",
        "sent",
        "compute",
        "idle",
        "waited",
        "cpu",
        if throttling { "  throttled" } else { "" }
    );
    for n in &s.per_node {
        // `idle` is everything but compute; `waited`, the part of it blocked on the network
        // (on a ring node: for an input, a gradient, or anything else).
        let throttled = match (throttling, n.throttled_seconds) {
            (true, Some(t)) => format!(" {t:>9.1}s"),
            (true, None) => format!(" {:>10}", "-"),
            (false, _) => String::new(),
        };
        println!(
            "{:>4} {:<7} {:>10} {:>8.1}MB {:>10} {:>8.1}s {:>8.1}s {:>8.1}s {:>8.1}s{throttled}",
            n.rank,
            n.role,
            n.params,
            n.peak_rss_bytes as f64 / 1e6,
            n.bytes_sent,
            n.compute_seconds,
            n.idle_seconds,
            n.wait_seconds,
            n.cpu_seconds
        );
    }
    println!("summary: {}", out.join("summary.json").display());
}
