//! What `ringtmp compare` runs: its options (flags over a TOML file), the strategies named in
//! the short form (`ps:dssp:1:4`) and the `ringtmp train` arguments each run gets.
//!
//! Invariant: every configuration is checked — options, links, the strategy's own plan — before
//! the first run starts, so a bad spec is exit 2 at once and never after an hour of runs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use serde::Deserialize;

use crate::args::TrainArgs;
use crate::error::UsageError;

/// The strategies compared when none are named.
pub const DEFAULT_STRATEGIES: &str = "ring,ps:bsp,allreduce,dpsgd,adpsgd,diloco";

/// `ringtmp compare` options. Everything else on the command line is a `ringtmp train` option
/// shared by every run (model, data, epochs, links, …).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompareOptions {
    /// Strategies in the short form.
    pub strategies: Vec<String>,
    /// Node counts (a sweep when several).
    pub nodes: Vec<u32>,
    /// Runs per configuration.
    pub repeats: u32,
    /// Output directory.
    pub out: PathBuf,
    /// The shared `ringtmp train` arguments.
    pub train: Vec<String>,
    /// Runs `ringtmp simulate` instead of `train` (a study of clusters this machine lacks).
    pub simulate: bool,
    /// The simulations' cost model (`None`: measured once, by the first run).
    pub cost_model: Option<PathBuf>,
    /// `ringtmp simulate`'s failure options (`--failures-per-node-hour` and its companions),
    /// passed to every simulated run.
    pub failure_args: Vec<String>,
    /// Equal training time: every run trains for about this many seconds on its own training
    /// clock (its sample budget from a probe run's samples/s), instead of one sample budget.
    pub train_seconds: Option<f64>,
}

/// Samples a probe run of `--train-seconds` trains on to measure its configuration's samples/s:
/// enough steps that start-up (the first allocations, a pipeline's fill) weighs little, few
/// enough to cost a fraction of the runs themselves.
pub const PROBE_SAMPLES: u64 = 2048;

/// The TOML form: `strategies`, `nodes`, `repeats`, `out`, and a `[train]` table of `ringtmp
/// train` keys.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompareFile {
    strategies: Option<Vec<String>>,
    nodes: Option<Vec<u32>>,
    repeats: Option<u32>,
    out: Option<PathBuf>,
    train_seconds: Option<f64>,
    train: Option<toml::Table>,
}

/// Help for `ringtmp compare` (its own options are parsed by hand, the rest by `train`'s parser).
pub const HELP: &str = "\
Run several strategies on the same model, data, seed and emulated cluster, one after the other,
and write a side-by-side report (results.jsonl, report.md, report.html with plots).

Usage: ringtmp compare [--strategies LIST] [--nodes N[,N...]] [--repeats K] [--out DIR]
                       [--train-seconds T] [--config FILE] [--simulate [--cost-model FILE]]
                       [TRAIN OPTIONS...]

Options:
  --strategies LIST   comma-separated: ring[:SCHEDULE], ps:bsp, ps:ssp:S, ps:asp, ps:dssp:L:U,
                      allreduce, dpsgd[:ring|exp], adpsgd, local; a strategy's own
                      options follow +, e.g. ps:bsp+servers=2 or ring+wire-dtype=bf16
                      [default: ring,ps:bsp,allreduce,dpsgd,adpsgd]
  --nodes N[,N...]    nodes per run; several make a sweep (plotted against samples/s) [default: 4]
  --repeats K         runs per configuration (seeds S, S+1, ...); the report gives the median and
                      the range [default: 1]
  --out DIR           output directory; runs already finished there are not run again
                      [default: runs/<time>-compare]
  --train-seconds T   equal time instead of equal samples: every run trains for about T seconds
                      (its sample budget is T × the samples/s of a probe run of 2048 samples,
                      kept under runs/ as <run>-probe; a run that misses T by more than 15%
                      runs once more, its budget scaled by the miss); replaces --epochs and
                      --train-samples
  --config FILE       a TOML file: strategies, nodes, repeats, out, train_seconds, and a
                      [train] table
  --simulate          run `ringtmp simulate` instead of `train`: clusters this machine lacks
                      (no accuracy; one cost model for every run, measured by the first)
  --cost-model FILE   with --simulate: the cost model to use (from `simulate --save-cost-model`)
  --failures-per-node-hour RATE, --restart-seconds S, --disk-mbyte-s MB, --horizon-hours H
                      with --simulate: every run's useful fraction of time when nodes fail
                      (see `ringtmp simulate --help`); the report adds it and the effective
                      samples/s
  -h, --help          this help
Every other option is a `ringtmp train` option shared by all runs, e.g.
  ringtmp compare --strategies ring,ps:bsp,allreduce --nodes 4 --bandwidth-mbit 100 \\
      --latency-ms 2 --model mlp --epochs 2
";

/// Splits the command line into compare's own options and `train`'s, then layers them over the
/// `--config` file.
#[expect(
    clippy::too_many_lines,
    reason = "the compare mini-language's parser, a case per key; goes with typed arguments"
)]
pub fn parse(raw: &[String]) -> Result<Option<CompareOptions>> {
    let mut own: std::collections::BTreeMap<&str, String> = Default::default();
    let mut train = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let arg = raw[i].as_str();
        if arg == "-h" || arg == "--help" {
            print!("{HELP}");
            return Ok(None);
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (arg, None),
        };
        let key = match name {
            "--strategies" => "strategies",
            "--nodes" => "nodes",
            "--repeats" => "repeats",
            "--out" => "out",
            "--config" => "config",
            "--cost-model" => "cost-model",
            "--failures-per-node-hour" => "failures-per-node-hour",
            "--restart-seconds" => "restart-seconds",
            "--disk-mbyte-s" => "disk-mbyte-s",
            "--horizon-hours" => "horizon-hours",
            "--train-seconds" => "train-seconds",
            "--simulate" => {
                own.insert("simulate", "true".into());
                i += 1;
                continue;
            }
            "--strategy" => {
                return Err(UsageError(
                    "compare takes --strategies (a list), not --strategy".into(),
                )
                .into());
            }
            _ => {
                train.push(raw[i].clone());
                i += 1;
                continue;
            }
        };
        let value = match inline {
            Some(v) => v,
            None => {
                i += 1;
                raw.get(i)
                    .cloned()
                    .ok_or_else(|| UsageError(format!("{name} needs a value")))?
            }
        };
        own.insert(key, value);
        i += 1;
    }
    let file: CompareFile = match own.get("config") {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| UsageError(format!("compare config {path}: {e}")))?;
            toml::from_str(&text).map_err(|e| {
                UsageError(format!(
                    "compare config {path}: {}",
                    e.to_string().trim_end()
                ))
            })?
        }
        None => CompareFile::default(),
    };
    let strategies: Vec<String> = match own.get("strategies") {
        Some(list) => list.split(',').map(|s| s.trim().to_string()).collect(),
        None => file
            .strategies
            .clone()
            .unwrap_or_else(|| DEFAULT_STRATEGIES.split(',').map(String::from).collect()),
    };
    let nodes: Vec<u32> = match own.get("nodes") {
        Some(list) => list
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .ok()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| UsageError(format!("--nodes {list:?}: expected counts ≥ 1")))
            })
            .collect::<std::result::Result<_, _>>()?,
        None => file.nodes.clone().unwrap_or_else(|| vec![4]),
    };
    let repeats = match own.get("repeats") {
        Some(k) => k
            .parse()
            .ok()
            .filter(|k| *k >= 1)
            .ok_or_else(|| UsageError(format!("--repeats {k:?}: expected a count ≥ 1")))?,
        None => file.repeats.unwrap_or(1),
    };
    if strategies.is_empty() || strategies.iter().any(String::is_empty) {
        return Err(UsageError("--strategies: an empty name".into()).into());
    }
    // The file's [train] keys come first, so the command line's flags win.
    let mut all_train = Vec::new();
    for (key, value) in file.train.iter().flatten() {
        let flag = format!("--{key}");
        match value {
            toml::Value::Boolean(true) => all_train.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::String(s) => all_train.extend([flag, s.clone()]),
            toml::Value::Array(items) => {
                for item in items {
                    let text = match item {
                        toml::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    all_train.extend([flag.clone(), text]);
                }
            }
            other => all_train.extend([flag, other.to_string()]),
        }
    }
    all_train.extend(train);
    let out = own
        .get("out")
        .map(PathBuf::from)
        .or(file.out)
        .unwrap_or_else(|| crate::run_dir::default_out("compare"));
    let simulate = own.contains_key("simulate");
    let cost_model = own.get("cost-model").map(PathBuf::from);
    if cost_model.is_some() && !simulate {
        return Err(UsageError("--cost-model applies to --simulate only".into()).into());
    }
    let mut failure_args = Vec::new();
    for key in [
        "failures-per-node-hour",
        "restart-seconds",
        "disk-mbyte-s",
        "horizon-hours",
    ] {
        if let Some(value) = own.get(key) {
            if !simulate {
                return Err(UsageError(format!("--{key} applies to --simulate only")).into());
            }
            failure_args.extend([format!("--{key}"), value.clone()]);
        }
    }
    let train_seconds = match own.get("train-seconds") {
        Some(t) => Some(
            t.parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    UsageError(format!("--train-seconds {t:?}: expected seconds > 0"))
                })?,
        ),
        None => file.train_seconds,
    };
    if train_seconds.is_some() {
        if simulate {
            return Err(UsageError(
                "--train-seconds applies to real runs (a simulation has no accuracy to compare \
                 at equal time)"
                    .into(),
            )
            .into());
        }
        if let Some(flag) = all_train
            .iter()
            .find(|a| ["--epochs", "--train-samples"].contains(&a.split('=').next().unwrap_or("")))
        {
            return Err(UsageError(format!(
                "--train-seconds and {flag} both say how long to train; give one"
            ))
            .into());
        }
    }
    Ok(Some(CompareOptions {
        strategies,
        nodes,
        repeats,
        out,
        train: all_train,
        simulate,
        cost_model,
        failure_args,
        train_seconds,
    }))
}

/// The `ringtmp train` arguments of strategy `spec` in the short form, with its own options
/// after `+`: `ps:bsp+servers=2` is `--strategy ps --consistency bsp --servers 2`, and
/// `ring+master-holds-head` gives the flag alone.
pub fn strategy_args(spec: &str) -> Result<Vec<String>> {
    let mut pieces = spec.split('+');
    let strategy = pieces.next().unwrap_or_default();
    let mut args = base_strategy_args(spec, strategy)?;
    for option in pieces {
        let (key, value) = match option.split_once('=') {
            Some((key, value)) => (key, Some(value)),
            None => (option, None),
        };
        if key.is_empty() || key.starts_with('-') || value.is_some_and(str::is_empty) {
            return Err(UsageError(format!(
                "{spec:?}: {option:?} is not an option (expected +NAME=VALUE or +FLAG, \
                 e.g. ps:bsp+servers=2)"
            ))
            .into());
        }
        args.push(format!("--{key}"));
        args.extend(value.map(str::to_string));
    }
    Ok(args)
}

/// The arguments of the strategy part of `spec`: a strategy's name, or its short form
/// `NAME:VALUE` for the option the strategy names ([`ringtmp_strategy::Strategy::SHORT_FORM`]).
fn base_strategy_args(spec: &str, strategy: &str) -> Result<Vec<String>> {
    use ringtmp_strategy::Job;
    let (name, value) = match strategy.split_once(':') {
        Some((name, value)) => (name, Some(value)),
        None => (strategy, None),
    };
    let bad = || {
        let short: Vec<String> = Job::NAMES
            .iter()
            .filter_map(|n| Job::short_form(n).map(|(_, value)| format!("{n}:{value}")))
            .collect();
        UsageError(format!(
            "unknown strategy {spec:?} (expected a strategy's name — {} — or a short form: {})",
            Job::NAMES.join(", "),
            short.join(", ")
        ))
    };
    if !Job::NAMES.contains(&name) {
        return Err(bad().into());
    }
    let mut args = vec!["--strategy".to_string(), name.to_string()];
    match (value, Job::short_form(name)) {
        (None, _) => {}
        (Some(value), Some((flag, _))) if !value.is_empty() => {
            args.extend([flag.to_string(), value.to_string()]);
        }
        (Some(_), _) => return Err(bad().into()),
    }
    Ok(args)
}

/// One run of the comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    /// The strategy in the short form.
    pub strategy: String,
    /// Nodes.
    pub nodes: u32,
    /// Repeat index (0-based).
    pub repeat: u32,
    /// Directory name under `runs/`.
    pub name: String,
    /// The whole `ringtmp train` argument list (without the output directory).
    pub args: Vec<String>,
}

/// Every run of `options`, in order: node counts, then strategies, then repeats.
pub fn runs(options: &CompareOptions) -> Result<Vec<RunPlan>> {
    let base = TrainArgs::parse_train(&options.train)?;
    let seed = base.training.seed.unwrap_or(42);
    let mut runs = Vec::new();
    let share = if base.cluster.node_cpu.is_none() && !options.simulate {
        // (Simulated nodes have their own cores.)
        sweep_share(options)
    } else {
        None
    };
    for &nodes in &options.nodes {
        for strategy in &options.strategies {
            let mut args = strategy_args(strategy)?;
            args.extend(options.train.iter().cloned());
            // `local` is one node: on the same share, it is the sweep's one-node point.
            let ranks = if strategy == "local" { 1 } else { nodes };
            if strategy != "local" {
                args.extend(["--nodes".into(), nodes.to_string()]);
            }
            if let Some(share) = share {
                let every: Vec<String> = (0..ranks).map(|r| format!("{r}:{share}")).collect();
                args.extend(["--node-cpu".into(), every.join(",")]);
            }
            for repeat in 0..options.repeats {
                let mut args = args.clone();
                if repeat > 0 {
                    args = without_seed(&args);
                    args.extend(["--seed".into(), (seed + u64::from(repeat)).to_string()]);
                }
                let name = format!(
                    "{}-n{nodes}-r{repeat}",
                    strategy
                        .replace([':', '+'], "_")
                        .replace('=', "")
                        .replace(['/', ' '], "-")
                );
                runs.push(RunPlan {
                    strategy: strategy.clone(),
                    nodes,
                    repeat,
                    name,
                    args,
                });
            }
        }
    }
    Ok(runs)
}

/// In a sweep of node counts, the CPU share every node gets so that it is the same at every
/// count: the machine's cores over the largest count (at most one core), applied through
/// `--node-cpu` unless the user set it (to `local`'s one process too). `None` for one node count.
pub fn sweep_share(options: &CompareOptions) -> Option<f64> {
    if options.nodes.len() < 2 {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let most = options.nodes.iter().copied().max().unwrap_or(1).max(1);
    let share = (cores / f64::from(most)).min(1.0);
    // Two decimals, rounded down, so the shares never add up to more than the machine.
    Some((share * 100.0).floor() / 100.0)
}

/// `args` without a `--seed` option (a repeat sets its own).
fn without_seed(args: &[String]) -> Vec<String> {
    without_option(args, "--seed")
}

/// `args` without option `flag` and its value (either `--flag V` or `--flag=V`).
pub fn without_option(args: &[String], flag: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == flag {
            skip = true;
        } else if !a.starts_with(&format!("{flag}=")) {
            out.push(a.clone());
        }
    }
    out
}

/// The name of the probe run that measures `plan`'s configuration for `--train-seconds` (one
/// for all its repeats).
pub fn probe_name(plan: &RunPlan) -> String {
    match plan.name.rsplit_once("-r") {
        Some((config, _)) => format!("{config}-probe"),
        None => format!("{}-probe", plan.name),
    }
}

/// `plan`'s arguments for its probe run: `PROBE_SAMPLES` samples, no evaluation.
pub fn probe_args(plan: &RunPlan) -> Vec<String> {
    let mut args = without_option(&without_seed(&plan.args), "--eval-every");
    args.extend([
        "--train-samples".into(),
        PROBE_SAMPLES.to_string(),
        "--eval-every".into(),
        "0".into(),
    ]);
    args
}

impl TrainArgs {
    /// `ringtmp train` options from an argument list (without the command name).
    pub fn parse_train(args: &[String]) -> Result<TrainArgs> {
        #[derive(Parser)]
        #[command(name = "ringtmp train", allow_negative_numbers = true)]
        struct Wrapper {
            #[command(flatten)]
            train: TrainArgs,
        }
        let parsed = Wrapper::try_parse_from(
            std::iter::once("ringtmp train".to_string()).chain(args.iter().cloned()),
        )
        .map_err(|e| UsageError(e.to_string().trim_end().to_string()))
        .context("in the training options given to compare")?;
        Ok(parsed.train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn short_forms_become_train_flags() {
        assert_eq!(
            strategy_args("ps:dssp:1:4").unwrap(),
            strings(&["--strategy", "ps", "--consistency", "dssp:1:4"])
        );
        assert_eq!(
            strategy_args("dpsgd:exp").unwrap(),
            strings(&["--strategy", "dpsgd", "--topology", "exp"])
        );
        assert_eq!(
            strategy_args("diloco:100+outer-fragments=4").unwrap(),
            strings(&[
                "--strategy",
                "diloco",
                "--inner-steps",
                "100",
                "--outer-fragments",
                "4"
            ])
        );
        assert!(strategy_args("horovod").is_err());
        assert!(strategy_args("allreduce:fast").is_err());
        // A strategy's own options.
        assert_eq!(
            strategy_args("ps:bsp+servers=2+drop-dead-workers").unwrap(),
            strings(&[
                "--strategy",
                "ps",
                "--consistency",
                "bsp",
                "--servers",
                "2",
                "--drop-dead-workers"
            ])
        );
        for bad in ["ring+", "ring+=2", "ring+--x=1", "ring+wire-dtype="] {
            assert!(strategy_args(bad).is_err(), "{bad}");
        }
        let o = parse(&strings(&["--strategies", "ps:bsp+servers=2"]))
            .unwrap()
            .unwrap();
        assert_eq!(runs(&o).unwrap()[0].name, "ps_bsp_servers2-n4-r0");
    }

    #[test]
    fn own_flags_are_taken_and_the_rest_passes_through() {
        let o = parse(&strings(&[
            "--strategies",
            "ring,ps:bsp",
            "--nodes=2,4",
            "--model",
            "mlp",
            "--repeats",
            "3",
            "--out",
            "x",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(o.strategies, ["ring", "ps:bsp"]);
        assert_eq!(o.nodes, [2, 4]);
        assert_eq!(o.repeats, 3);
        assert_eq!(o.train, ["--model", "mlp"]);
        let runs = runs(&o).unwrap();
        assert_eq!(runs.len(), 2 * 2 * 3);
        // A sweep: every node gets the same share at every count.
        let share = sweep_share(&o).unwrap();
        assert!(share > 0.0 && share <= 1.0);
        let cpu = runs[0].args.iter().position(|a| a == "--node-cpu").unwrap();
        assert_eq!(runs[0].args[cpu + 1], format!("0:{share},1:{share}"));
        // `local`, the one-node point of the sweep, on the same share.
        let with_local = parse(&strings(&["--strategies", "local,ring", "--nodes=2,4"]))
            .unwrap()
            .unwrap();
        let local = &super::runs(&with_local).unwrap()[0];
        assert_eq!(local.strategy, "local");
        let cpu = local.args.iter().position(|a| a == "--node-cpu").unwrap();
        assert_eq!(local.args[cpu + 1], format!("0:{share}"));
        assert!(!local.args.contains(&"--nodes".to_string()));
        assert_eq!(runs[0].name, "ring-n2-r0");
        assert!(runs[1].args.ends_with(&strings(&["--seed", "43"])));
        assert!(parse(&strings(&["--strategy", "ring"])).is_err());
        let with_seed = parse(&strings(&["--repeats", "2", "--seed", "7"]))
            .unwrap()
            .unwrap();
        let runs = super::runs(&with_seed).unwrap();
        assert_eq!(runs[1].args.iter().filter(|a| *a == "--seed").count(), 1);
        assert!(runs[1].args.ends_with(&strings(&["--seed", "8"])));
        assert!(parse(&strings(&["--nodes", "0"])).is_err());
    }

    #[test]
    fn equal_time_replaces_the_sample_budget_and_probes_once_per_configuration() {
        let o = parse(&strings(&[
            "--strategies",
            "ring",
            "--repeats",
            "2",
            "--train-seconds",
            "90",
            "--eval-every",
            "5",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(o.train_seconds, Some(90.0));
        let runs = runs(&o).unwrap();
        // Both repeats share one probe, which trains PROBE_SAMPLES and never evaluates.
        assert_eq!(probe_name(&runs[0]), "ring-n4-probe");
        assert_eq!(probe_name(&runs[1]), "ring-n4-probe");
        let probe = probe_args(&runs[1]);
        assert!(probe.ends_with(&strings(&[
            "--train-samples",
            &PROBE_SAMPLES.to_string(),
            "--eval-every",
            "0"
        ])));
        assert_eq!(probe.iter().filter(|a| *a == "--eval-every").count(), 1);
        assert!(!probe.contains(&"--seed".to_string()));
        for bad in [
            vec!["--train-seconds", "0"],
            vec!["--train-seconds", "-3"],
            vec!["--train-seconds", "soon"],
            vec!["--train-seconds", "60", "--epochs", "2"],
            vec!["--train-seconds", "60", "--train-samples=900"],
            vec!["--train-seconds", "60", "--simulate"],
        ] {
            let err = parse(&strings(&bad)).unwrap_err().to_string();
            assert!(err.contains("--train-seconds"), "{bad:?}: {err}");
        }
    }
}
