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
}

impl Display {
    /// A display for this terminal (or pipe).
    pub fn new() -> Self {
        Self {
            bar: None,
            total: 0,
            last_line: Instant::now(),
            accuracy: None,
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
                let acc = self
                    .accuracy
                    .map(|a| format!(" test acc {:.2}%", a * 100.0))
                    .unwrap_or_default();
                if let Some(bar) = &self.bar {
                    bar.set_position(step);
                    bar.set_message(format!(
                        "epoch {epoch} loss {loss:.4}{acc} {samples_per_second:.0} samples/s"
                    ));
                } else if self.last_line.elapsed().as_secs_f64() >= 5.0 || step == self.total {
                    self.last_line = Instant::now();
                    eprintln!(
                        "step {step}/{} epoch {epoch} loss {loss:.4}{acc} {samples_per_second:.0} samples/s",
                        self.total
                    );
                }
            }
            Event::Eval {
                step,
                epoch,
                accuracy,
                loss,
            } => {
                self.accuracy = Some(accuracy);
                let line = format!(
                    "eval step {step} epoch {epoch}: test accuracy {:.2}%, test loss {loss:.4}",
                    accuracy * 100.0
                );
                match &self.bar {
                    Some(bar) => bar.println(line),
                    None => eprintln!("{line}"),
                }
            }
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

/// Prints the result of a run and the per-node table.
pub fn print_summary(s: &Summary, out: &std::path::Path) {
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
