//! `ringtmp compare`: runs a set of strategies on the same model, data, seed and emulated cluster,
//! one after the other, and writes a side-by-side report.
//!
//! Layout of the output directory:
//! ```text
//! <out>/runs/<strategy>-n<nodes>-r<repeat>/   every run's own directory (ringtmp train --out)
//! <out>/runs/<...>.log                         what the run printed
//! <out>/runs/<strategy>-n<nodes>-probe/        with --train-seconds: the run that measured the
//!                                              configuration's samples/s (one for its repeats)
//! <out>/results.jsonl                          one line per finished run, from its summary.json
//! <out>/report.md, <out>/report.html           the report (plots inline in the HTML)
//! <out>/plots/*.svg                            the plots
//! ```
//! Invariants: every configuration is checked before the first run starts; a run whose
//! directory already holds a summary is not run again (so a comparison interrupted or extended
//! resumes where it stopped); the report is computed from the runs' summaries and metrics only.
//!
//! # Layout
//! - [`spec`]: options, strategies in the short form, the run list.
//! - [`report`]: results, tables and plots.

mod claims;
mod plots;
mod quality;
mod render;
pub mod report;
mod runs;
pub mod spec;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};

use crate::args::TrainArgs;
use crate::error::UsageError;
use spec::{CompareOptions, RunPlan};

/// `ringtmp compare` with its raw arguments.
pub fn run(raw: &[String]) -> Result<()> {
    let Some(options) = spec::parse(raw)? else {
        return Ok(());
    };
    let runs = spec::runs(&options)?;
    check(&options, &runs)?;
    // A directory that cannot be made is the user's to fix, as `train` says it (exit 2).
    std::fs::create_dir_all(options.out.join("runs")).map_err(|e| {
        crate::error::UsageError(format!(
            "cannot create the output directory {}: {e}",
            options.out.display()
        ))
    })?;
    eprintln!(
        "compare: {} run(s) ({} strategies × {} node count(s) × {} repeat(s)); output in {}",
        runs.len(),
        options.strategies.len(),
        options.nodes.len(),
        options.repeats,
        options.out.display()
    );
    if let Some(seconds) = options.train_seconds {
        // Said before the first run, so that nobody wonders why there are twice as many.
        eprintln!(
            "compare: equal training time ({seconds} s each): every configuration runs twice, \
             a short probe that measures its samples/s, then the run of that many samples \
             (the probes are kept, and reused by a later compare)"
        );
    }
    let exe = std::env::current_exe().context("locating the ringtmp binary")?;
    for (i, plan) in runs.iter().enumerate() {
        let dir = options.out.join("runs").join(&plan.name);
        let label = format!(
            "[{}/{}] {} on {} node(s), repeat {}",
            i + 1,
            runs.len(),
            plan.strategy,
            plan.nodes,
            plan.repeat + 1
        );
        if dir.join("summary.json").is_file() {
            eprintln!("compare: {label}: finished before, kept");
            continue;
        }
        // `local` is one process at every node count of a sweep, so its runs there have the
        // same arguments: run once, its results stand at each count (`same-as` says whose).
        if let Some(same) = runs[..i].iter().find(|p| p.args == plan.args) {
            let source = options.out.join("runs").join(&same.name);
            if source.join("summary.json").is_file() {
                copy_dir(&source, &dir)?;
                let log = source.with_extension("log");
                if log.is_file() {
                    std::fs::copy(&log, dir.with_extension("log"))
                        .with_context(|| format!("copying {}", log.display()))?;
                }
                std::fs::write(dir.join("same-as"), format!("{}\n", same.name))
                    .with_context(|| format!("writing {}", dir.join("same-as").display()))?;
                eprintln!(
                    "compare: {label}: the same arguments as {}: its results, not run again",
                    same.name
                );
                continue;
            }
        }
        let mut budget = None;
        if let Some(seconds) = options.train_seconds {
            match budget_for(&exe, &options, plan, seconds, &label) {
                Ok(samples) => budget = Some(samples),
                Err(e) => {
                    // As a failed run: said, a row of the report that says so (from its log),
                    // and the others go on.
                    eprintln!("compare: {label}: FAILED: {e:#} — a failed row in the report");
                    let log = dir.with_extension("log");
                    std::fs::create_dir_all(options.out.join("runs"))?;
                    std::fs::write(&log, format!("error: {e:#}\n"))
                        .with_context(|| format!("writing {}", log.display()))?;
                    continue;
                }
            }
        }
        eprintln!("compare: {label} …");
        let started = Instant::now();
        let mut status = run_one(&exe, &options, &with_budget(plan, budget), &dir)?;
        // A probe is short, and some strategies run slower in a short run than in a long one
        // (AD-PSGD's last iterations wait for its grants to drain): a run whose training time
        // misses the budget by more than 15% runs once more, its budget scaled by the miss
        // (unless that is the budget it ran: a run already at the smallest budget, slower than
        // the time allows, would only run the same again).
        if let (Some(seconds), Some(samples), Some(s)) =
            (options.train_seconds, budget, report::read_summary(&dir))
            && status.success()
            && (s.train_seconds - seconds).abs() > 0.15 * seconds
            && s.train_seconds > 0.0
        {
            let corrected = ((samples as f64 * seconds / s.train_seconds).ceil() as u64)
                .max(spec::PROBE_SAMPLES);
            if corrected != samples {
                eprintln!(
                    "compare: {label}: trained {:.1} s of {seconds} s on {samples} samples; once \
                     more on {corrected}",
                    s.train_seconds
                );
                status = run_one(&exe, &options, &with_budget(plan, Some(corrected)), &dir)?;
            }
        }
        let took = started.elapsed().as_secs_f64();
        match report::read_summary(&dir) {
            Some(s) if status.success() && options.simulate => eprintln!(
                "compare: {label}: {:.0} samples/s simulated ({:.1} s of training), {took:.1} s",
                s.samples_per_second, s.train_seconds
            ),
            Some(s) if status.success() => match (&s.language, &s.regression) {
                (_, Some(r)) => eprintln!(
                    "compare: {label}: R² {:.4} final, RMSE {:.4}, MAE {:.4}, {:.0} samples/s, \
                     {took:.1} s",
                    r.final_test_r2, r.final_test_rmse, r.final_test_mae, s.samples_per_second
                ),
                (Some(l), _) => eprintln!(
                    "compare: {label}: validation loss {:.3} final ({:.3} best), {:.0} tokens/s, \
                     {took:.1} s",
                    l.final_val_loss, l.best_val_loss, l.tokens_per_second
                ),
                (None, None) => eprintln!(
                    "compare: {label}: {:.2}% final ({:.2}% best), {:.0} samples/s, {took:.1} s",
                    100.0 * s.final_test_accuracy,
                    100.0 * s.best_test_accuracy,
                    s.samples_per_second
                ),
            },
            _ => eprintln!(
                "compare: {label}: FAILED ({status}); see {}.log — a failed row in the report",
                dir.display()
            ),
        }
    }
    let (written, failed) = report::write(&options)?;
    eprintln!(
        "compare: {} run(s) in the report{}: {}",
        written,
        if failed > 0 {
            format!(", and {failed} that failed")
        } else {
            String::new()
        },
        options.out.join("report.html").display()
    );
    Ok(())
}

/// Copies directory `from` (files and subdirectories) to `to`, replacing what `to` held.
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to).with_context(|| format!("clearing {}", to.display()))?;
    }
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// `plan` with `--train-samples samples` added, when there is a budget.
fn with_budget(plan: &RunPlan, samples: Option<u64>) -> RunPlan {
    let mut plan = plan.clone();
    if let Some(samples) = samples {
        plan.args
            .extend(["--train-samples".into(), samples.to_string()]);
    }
    plan
}

/// The sample budget that gives `plan` about `seconds` of training: its probe run's samples/s
/// (measured once per configuration, kept under `runs/<config>-probe`) times `seconds`, at
/// least the probe's own samples.
fn budget_for(
    exe: &Path,
    options: &CompareOptions,
    plan: &RunPlan,
    seconds: f64,
    label: &str,
) -> Result<u64> {
    let probe = RunPlan {
        name: spec::probe_name(plan),
        args: spec::probe_args(plan),
        ..plan.clone()
    };
    let dir = options.out.join("runs").join(&probe.name);
    if report::read_summary(&dir).is_none() {
        eprintln!(
            "compare: {label}: probe of {} samples for its samples/s …",
            spec::PROBE_SAMPLES
        );
        let status = run_one(exe, options, &probe, &dir)?;
        if !status.success() {
            anyhow::bail!(
                "compare: the probe run of {} failed ({status}); see {}.log",
                plan.strategy,
                dir.display()
            );
        }
    }
    let Some(summary) = report::read_summary(&dir) else {
        anyhow::bail!("compare: the probe run {} wrote no summary", dir.display());
    };
    let rate = summary.samples_per_second;
    if !(rate.is_finite() && rate > 0.0) {
        anyhow::bail!(
            "compare: the probe run {} measured {rate} samples/s",
            dir.display()
        );
    }
    let samples = ((rate * seconds).ceil() as u64).max(spec::PROBE_SAMPLES);
    eprintln!(
        "compare: {label}: {rate:.0} samples/s in its probe, so {samples} samples for {seconds} s"
    );
    Ok(samples)
}

/// Runs one `ringtmp train` into `dir`, its output in `dir.log`.
fn run_one(
    exe: &Path,
    options: &CompareOptions,
    plan: &RunPlan,
    dir: &Path,
) -> Result<std::process::ExitStatus> {
    let log_path = dir.with_extension("log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut command = Command::new(exe);
    command
        .arg(if options.simulate {
            "simulate"
        } else {
            "train"
        })
        .args(&plan.args);
    if options.simulate {
        // One cost model for every run: the user's, or the one the first run measures.
        let measured = options.out.join("cost-model.json");
        match &options.cost_model {
            Some(path) => command.arg("--cost-model").arg(path),
            None if measured.is_file() => command.arg("--cost-model").arg(&measured),
            None => command.arg("--save-cost-model").arg(&measured),
        };
        command.args(&options.failure_args);
    }
    command
        .arg("--out")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    if dir.exists() {
        // A run cut short before it wrote its summary: start it again from nothing.
        command.arg("--overwrite");
    }
    command
        .status()
        .with_context(|| format!("running {}", plan.name))
}

/// Checks every configuration (options, links and the strategy's plan) before anything runs.
fn check(options: &CompareOptions, runs: &[RunPlan]) -> Result<()> {
    let mut data = None;
    for plan in runs.iter().filter(|r| r.repeat == 0) {
        let what = format!("{} on {} node(s)", plan.strategy, plan.nodes);
        let args = TrainArgs::parse_train(&plan.args)
            .and_then(|a| a.merged())
            .with_context(|| what.clone())?;
        args.check_applicable().with_context(|| what.clone())?;
        if args.output.out.is_some() {
            return Err(UsageError(
                "--out is compare's own option: every run gets a directory under it".into(),
            )
            .into());
        }
        if plan.strategy == "local" {
            if options.simulate {
                return Err(UsageError(
                    "compare --simulate: local is not simulated (it trains in one process)".into(),
                )
                .into());
            }
            let cores = crate::cgroup::parse_node_cpu(
                args.cluster.node_cpu.as_deref().unwrap_or_default(),
                1,
            )
            .with_context(|| what.clone())?;
            crate::cgroup::NodeCgroups::check(&cores, &[])?;
            continue;
        }
        args.node_links(plan.nodes).with_context(|| what.clone())?;
        let cores = crate::cgroup::parse_node_cpu(
            args.cluster.node_cpu.as_deref().unwrap_or_default(),
            plan.nodes,
        )
        .with_context(|| what.clone())?;
        if !options.simulate {
            crate::cgroup::NodeCgroups::check(&cores, &[])?;
        }
        if data.is_none() {
            data = Some(crate::plan::load_dataset(&args, false)?);
        }
        let data = data.as_ref().expect("loaded above");
        let cfg = args.resolve_for(data).with_context(|| what.clone())?;
        // Planned as the run will be: the local launcher's nodes share this machine's cores
        // unless they have quotas (the check once planned them as separate machines, and
        // printed a plan the run did not use).
        if options.simulate {
            crate::plan::plan(&args, cfg, data, plan.nodes).with_context(|| what.clone())?;
        } else {
            crate::plan::plan_here(&args, cfg, data, plan.nodes, &cores)
                .with_context(|| what.clone())?;
        }
    }
    Ok(())
}
