//! `ringtmp train` and `ringtmp validate-config`: load the data, run the strategy, show progress
//! (a bar on a terminal, plain lines otherwise) and print the result.

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use ringtmp_data::{Dataset, FileCheck};
use ringtmp_metrics::Summary;
use ringtmp_strategy::{Cluster, Event, Job, train_local};

use crate::args::TrainArgs;

/// Loads the dataset named by the options and reports its checksum verification: on the terminal
/// when `announce`, else as an informational log line (a node whose launcher said it already).
pub fn load_dataset(args: &TrainArgs, announce: bool) -> Result<Dataset> {
    let name = args.dataset();
    let started = Instant::now();
    // The data crate's errors name the dataset and the files already.
    let data = ringtmp_data::load(&name, args.data_dir.as_deref())?;
    let verified = data
        .checks
        .iter()
        .filter(|c| matches!(c, FileCheck::Verified { .. }))
        .count();
    for check in &data.checks {
        if let FileCheck::Mismatch {
            path,
            expected,
            got,
        } = check
        {
            eprintln!(
                "WARNING: {} differs from the canonical {name}: SHA-256 {got}, expected {expected}. \
                 Results will not be comparable with published ones.",
                path.display()
            );
        }
    }
    let line = format!(
        "dataset {name}: {} train / {} test examples from {} ({verified} of {} files match the canonical SHA-256; {:.1}s)",
        data.train.len(),
        data.test.len(),
        data.source.display(),
        data.checks.len(),
        started.elapsed().as_secs_f64()
    );
    if announce {
        eprintln!("{line}");
    } else {
        tracing::info!("{line}");
    }
    Ok(data)
}

/// `ringtmp validate-config`: resolves everything a run would, without training.
pub fn validate(args: &TrainArgs) -> Result<()> {
    let args = args.merged()?;
    args.check_applicable()?;
    let data = load_dataset(&args, true)?;
    let cfg = args.resolve(data.classes)?;
    let (h, w, c) = data.input;
    let layers = cfg
        .model
        .build(&ringtmp_model::Shape::image(h, w, c), data.classes)?;
    let params: usize = layers.iter().map(|l| l.param_count()).sum();
    println!(
        "ok: model {} ({} layers, {params} parameters) on {}",
        cfg.model.name,
        layers.len(),
        cfg.dataset
    );
    for l in &layers {
        println!(
            "  {:>2} {:<10} {} -> {}  ({} params)",
            l.index,
            l.kind_name(),
            l.input,
            l.output,
            l.param_count()
        );
    }
    Ok(())
}

/// `ringtmp train`.
pub fn run(args: &TrainArgs) -> Result<()> {
    let mut args = args.merged()?;
    if args.nodes.unwrap_or(1) > 1 && args.strategy() == "local" {
        return Err(crate::UsageError(
            "--strategy local trains in one process; --nodes needs a distributed strategy \
             (check a multi-node setup with `ringtmp selftest --nodes N`)"
                .into(),
        )
        .into());
    }
    args.check_applicable()?;
    args.adopt_checkpoint_batch()?;
    if args.strategy() != "local" {
        return launch_nodes(args);
    }
    let data = load_dataset(&args, true)?;
    let cfg = args.resolve(data.classes)?;
    crate::run_dir::prepare(
        &cfg.out,
        cfg.resume.as_deref(),
        args.overwrite.unwrap_or(false),
    )?;
    init_threads(cfg.threads)?;
    eprintln!(
        "training {} with strategy local, batch {}, lr {}, {} thread(s); output in {}",
        cfg.model.name,
        cfg.batch_size,
        cfg.lr,
        cfg.threads,
        cfg.out.display()
    );
    let Job::Local(job) = plan(&args, cfg, &data, 1)? else {
        unreachable!("--strategy local plans a local job")
    };
    let mut display = Display::new();
    let summary = train_local(&job.spec.config, &data, &mut |e| display.event(e))?;
    display.finish();
    print_summary(&summary, &job.spec.out);
    Ok(())
}

/// Plans the job of `args`'s strategy for `nodes` nodes from the resolved configuration: the one
/// place where flags become a job, for the local launcher and external launchers alike.
pub fn plan(
    args: &TrainArgs,
    cfg: ringtmp_strategy::TrainConfig,
    data: &Dataset,
    nodes: u32,
) -> Result<Job> {
    let mut cluster = Cluster::local(nodes)
        .with_speeds(args.node_speed.as_deref().unwrap_or_default())
        .map_err(|e| crate::UsageError(e.to_string()))?;
    cluster.threads = args.threads;
    let job = Job::plan(
        args.strategy(),
        cfg,
        &args.strategy_options(),
        &cluster,
        data,
    )?;
    job.validate(nodes)?;
    Ok(job)
}

/// Sizes rayon's global pool (through which the kernels parallelise) to the thread budget, and
/// makes every compute thread flush subnormals. Only the first call in a process has an effect.
pub fn init_threads(threads: usize) -> Result<()> {
    ringtmp_model::kernels::flush_denormals();
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .start_handler(|_| ringtmp_model::kernels::flush_denormals())
        .build_global();
    if built.is_err() && rayon::current_num_threads() != threads.max(1) {
        tracing::warn!(
            "compute threads already set to {}",
            rayon::current_num_threads()
        );
    }
    Ok(())
}

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
    println!(
        "{:>4} {:<7} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9}",
        "rank", "role", "params", "peak RSS", "sent", "compute", "idle", "cpu"
    );
    for n in &s.per_node {
        println!(
            "{:>4} {:<7} {:>10} {:>8.1}MB {:>10} {:>8.1}s {:>8.1}s {:>8.1}s",
            n.rank,
            n.role,
            n.params,
            n.peak_rss_bytes as f64 / 1e6,
            n.bytes_sent,
            n.compute_seconds,
            n.idle_seconds,
            n.cpu_seconds
        );
    }
    println!("summary: {}", out.join("summary.json").display());
}

/// `ringtmp train --strategy ring|ps`: checks and plans the job, writes it and the options for
/// rank 0, and starts the local nodes.
fn launch_nodes(mut args: TrainArgs) -> Result<()> {
    let nodes = args.nodes.unwrap_or(4);
    if nodes < 2 {
        return Err(
            crate::UsageError("distributed strategies need --nodes of at least 2".into()).into(),
        );
    }
    let name = args.strategy().to_string();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| crate::run_dir::default_out(&name));
    args.out = Some(out.clone());
    args.nodes = Some(nodes);
    args.config = None;
    // Check everything and plan here, before any process starts: a bad option is a usage error
    // (exit 2) of this command, and the plan printed is the one the nodes run.
    let data = load_dataset(&args, true)?;
    let cfg = args.resolve(data.classes)?;
    let job = plan(&args, cfg, &data, nodes)?;
    drop(data);
    crate::run_dir::prepare(
        &out,
        args.resume.as_deref(),
        args.overwrite.unwrap_or(false),
    )?;
    // The nodes see the directory as prepared; they must not refuse or clear it again.
    args.overwrite = None;
    eprintln!(
        "training with strategy {name} on {nodes} local node processes; output in {}",
        out.display()
    );
    let config = out.join("train.toml");
    std::fs::write(
        &config,
        toml::to_string(&args).context("encoding the training options")?,
    )
    .with_context(|| format!("writing {}", config.display()))?;
    let plan = out.join("job.json");
    std::fs::write(
        &plan,
        serde_json::to_string_pretty(&job).context("encoding the job")?,
    )
    .with_context(|| format!("writing {}", plan.display()))?;
    let (config, plan) = (config.display().to_string(), plan.display().to_string());
    // Nodes whose death the strategy survives (a parameter server dropping dead workers).
    let expendable = |rank: u32| job.expendable(rank);
    let node_args = |rank: u32| {
        let mut node_args = vec![
            "--job".into(),
            "train".into(),
            "--config".into(),
            config.clone(),
        ];
        if rank == 0 {
            node_args.extend(["--job-file".into(), plan.clone()]);
        }
        if args.crash_rank == Some(rank) {
            let after = args.crash_after_ms.unwrap_or(1000).to_string();
            node_args.extend(["--crash-after-ms".into(), after]);
        }
        if args.freeze_rank == Some(rank) {
            let after = args.freeze_after_ms.unwrap_or(1000).to_string();
            node_args.extend(["--freeze-after-ms".into(), after]);
        }
        node_args
    };
    let ended = crate::launcher::run(&crate::launcher::Launch {
        nodes,
        pin: args.pin.unwrap_or(false),
        verbose: args.verbose.unwrap_or(false),
        args: &node_args,
        expendable: &expendable,
    });
    // Every node has exited: a checkpoint without its manifest is one whose writing failed or was
    // cut short, and nothing will ever complete it.
    for dir in ringtmp_model::checkpoint::remove_incomplete(&out.join("checkpoints")) {
        eprintln!("removed the incomplete checkpoint {}", dir.display());
    }
    let ended = ended?;
    for rank in &ended.killed_after_run {
        eprintln!(
            "WARNING: node {rank} was still running {}s after the run ended and was killed",
            crate::launcher::AFTER_RUN_GRACE.as_secs()
        );
    }
    Ok(())
}
