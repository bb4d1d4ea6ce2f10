//! `ringtmp train` and `ringtmp validate-config`: load the data, run the strategy, show progress
//! (a bar on a terminal, plain lines otherwise) and print the result.

use anyhow::Result;
use ringtmp_strategy::{Job, train_local};

use crate::args::TrainArgs;
use crate::display::{Display, print_summary};
use crate::request::RunRequest;
use std::time::SystemTime;

use ringtmp_metrics::Restart;

use crate::error::{NodeFailed, UsageError};
use crate::plan::{init_threads, load_dataset, plan, plan_here};

/// `ringtmp validate-config`: resolves everything a run would, without training.
pub fn validate(args: &TrainArgs) -> Result<()> {
    let args = args.merged()?;
    args.check_applicable()?;
    let data = load_dataset(&args, true)?;
    let cfg = args.resolve_for(&data)?;

    let layers = ringtmp_strategy::layers_for(&cfg.model, &data)?;
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
    if let Some(arch) =
        ringtmp_model::arch::Architecture::of(&cfg.model, ringtmp_strategy::sequence_of(&data))
    {
        println!("  architecture: {}", arch.describe());
    }
    if crate::init_from::convert(&args, &cfg, &data)?.is_some() {
        println!("  --init-from: its weights fit the model");
    }
    Ok(())
}

/// `ringtmp train`.
pub fn run(args: &TrainArgs) -> Result<()> {
    let args = args.merged()?;
    if args.strategy.nodes.unwrap_or(1) > 1 && args.strategy() == "local" {
        return Err(UsageError(
            "--strategy local trains in one process; --nodes needs a distributed strategy \
             (check a multi-node setup with `ringtmp selftest --nodes N`)"
                .into(),
        )
        .into());
    }
    args.check_applicable()?;
    let mut request = args.resolve()?;
    // The default directory is created as it is chosen (runs started in the same second each
    // get their own); one that a refused run leaves empty goes again.
    let reserved = match &request.output.out {
        Some(_) => None,
        None => {
            let out = crate::run_dir::default_out(&request.strategy.name);
            request = request.writing_to(out.clone());
            Some(out)
        }
    };
    let result = run_resolved(&request);
    if let (Err(_), Some(out)) = (&result, reserved) {
        let _ = std::fs::remove_dir(out);
    }
    result
}

/// `ringtmp train` once the options are resolved and the output directory chosen.
fn run_resolved(request: &RunRequest) -> Result<()> {
    if request.strategy.name != "local" {
        return launch_nodes(request);
    }
    let args = request.options();
    // Under `taskset`, the hypervisor's steal on its cores counts from here (`steal_seconds`).
    ringtmp_metrics::resources::mark_start();
    // `--node-cpu 0:CORES`: the whole run (data loading too) on that share, as a node's would be.
    let cores =
        crate::cgroup::parse_node_cpu(args.cluster.node_cpu.as_deref().unwrap_or_default(), 1)?;
    let _quota = match cores[0] {
        Some(cores) => {
            let quota = crate::cgroup::ProcessQuota::apply(cores)?;
            eprintln!("runs under a CPU quota of {cores} core(s)");
            Some(quota)
        }
        None => None,
    };
    let data = load_dataset(&args, true)?;
    let mut cfg = args.resolve_for(&data)?;
    let init = crate::init_from::convert(&args, &cfg, &data)?;
    if init.is_some() {
        cfg.init_from = Some(crate::init_from::init_dir(&cfg.out));
    }
    let planned = plan(&args, cfg, &data, 1)?;
    let out = &planned.spec().config;
    crate::run_dir::prepare(&out.out, out.resume.as_deref(), request.overwrite())?;
    crate::run_dir::write_run_files(&out.out, &args, &planned)?;
    let Job::Local(job) = planned else {
        unreachable!("--strategy local plans a local job")
    };
    let cfg = &job.spec.config;
    if let (Some(init), Some(dir)) = (&init, &cfg.init_from) {
        init.write(dir)?;
    }
    init_threads(cfg.threads)?;
    eprintln!(
        "training {} with strategy local, batch {}, lr {}, {} thread(s); output in {}",
        cfg.model.name,
        cfg.batch_size,
        cfg.lr,
        cfg.threads,
        cfg.out.display()
    );
    let mut display =
        Display::for_language_model(job.spec.sequence, job.spec.vocabulary.as_deref());
    let summary = train_local(&job.spec.config, &data, &mut |e| display.event(e))?;
    display.finish();
    print_summary(&summary, &job.spec.out);
    Ok(())
}

/// `ringtmp train` with a distributed strategy: checks the node options, then runs the nodes —
/// again from the newest verified checkpoint after a node failure, up to `--max-restarts` times,
/// each attempt a request derived from the last.
fn launch_nodes(first: &RunRequest) -> Result<()> {
    if first.strategy.nodes < 2 {
        return Err(UsageError("distributed strategies need --nodes of at least 2".into()).into());
    }
    let out = first.out();
    let (max_restarts, shrink) = (first.faults.max_restarts, first.faults.shrink_on_failure);
    let mut request = first.clone();
    let mut cluster = LocalCluster::check(&request)?;
    // Each restart with the Unix time of the failure that caused it.
    let mut restarts: Vec<(Restart, f64)> = Vec::new();
    loop {
        let attempt_started = SystemTime::now();
        let failure = match launch_once(&request, &cluster, restarts.len()) {
            Ok(()) => break,
            Err(e) => e,
        };
        let Some(failed) = failure.downcast_ref::<NodeFailed>() else {
            return Err(failure);
        };
        if restarts.len() as u32 >= max_restarts {
            if max_restarts > 0 {
                eprintln!("launcher: no restarts left (--max-restarts {max_restarts})");
            }
            return Err(failure);
        }
        if failed.rank == 0 {
            eprintln!(
                "launcher: rank 0 failed; it is the master (it holds the data and the run's \
                 records), so the run does not restart without it"
            );
            return Err(failure);
        }
        let (next, mut restart, failed_at) = plan_restart(&request, &out, failed, attempt_started);
        request = next;
        if shrink {
            let nodes = request.strategy.nodes;
            if nodes <= 2 {
                eprintln!("launcher: --shrink-on-failure: {nodes} nodes cannot lose one");
                return Err(failure);
            }
            // Planned again without the lost node; the checkpoint's global batch is kept (split
            // over the workers that remain) unless the user chose the batch.
            request = request.without_rank(restart.rank)?;
            cluster = LocalCluster::check(&request)?;
        }
        let nodes = request.strategy.nodes;
        restart.nodes = nodes;
        eprintln!(
            "launcher: restart {}/{max_restarts}: node {} failed at step {} ({}); resuming from \
             step {} ({} step(s) to train again) on {nodes} nodes",
            restarts.len() + 1,
            restart.rank,
            restart.failed_at_step,
            restart.reason,
            restart.resumed_from_step,
            restart.steps_redone
        );
        restarts.push((restart, failed_at));
    }
    if !restarts.is_empty() {
        crate::restart::record(&out, restarts)?;
    }
    Ok(())
}

/// After node `failed` ended the attempt of `request` that started at `attempt_started`: the
/// next attempt's request, from the newest checkpoint that verifies (or from the beginning), and
/// what was lost; with the failure's Unix time (the downtime is measured from it once the
/// restarted run has started).
fn plan_restart(
    request: &RunRequest,
    out: &std::path::Path,
    failed: &NodeFailed,
    attempt_started: SystemTime,
) -> (RunRequest, Restart, f64) {
    let failed_at = SystemTime::now();
    let failed_at_step = crate::restart::last_step(out);
    let (found, skipped) = ringtmp_model::checkpoint::newest_verified(&out.join("checkpoints"));
    for reason in skipped {
        eprintln!("launcher: passing over {reason}");
    }
    let (resumed_from_step, since, dir) = match found {
        Some((dir, manifest)) => {
            let written = std::fs::metadata(dir.join("manifest.json"))
                .and_then(|m| m.modified())
                .unwrap_or(attempt_started);
            (manifest.step, written, Some(dir))
        }
        None => (0, attempt_started, None),
    };
    let next = request.resumed(dir);
    let cuts = kept_cuts(&next, out);
    let next = next.with_cut_inside(cuts);
    let restart = Restart {
        rank: failed.rank,
        reason: failed.message.clone(),
        failed_at_step,
        resumed_from_step,
        steps_redone: failed_at_step.saturating_sub(resumed_from_step),
        nodes: next.strategy.nodes,
        work_lost_seconds: failed_at
            .duration_since(since)
            .map_or(0.0, |d| d.as_secs_f64()),
        downtime_seconds: 0.0,
    };
    let unix = failed_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    (next, restart, unix)
}

/// A restarted ring cuts inside layers where the failed attempt did (`job.json`'s
/// `cuts_inside`), or nowhere when it did not: its stages may fall elsewhere, but it computes bit
/// for bit what the first attempt did (a cut layer's input gradient is summed in two parts, so a
/// cut chosen anew — on a timing that differs by noise — would differ by rounding). Cuts the
/// user gave, or `--cut-inside false`, stand as given. Either way the cuts are stage boundaries
/// only where they fit: a ring shrunk by a lost node may have fewer.
fn kept_cuts(
    request: &RunRequest,
    out: &std::path::Path,
) -> Option<ringtmp_strategy::ring::plan::CutInsideChoice> {
    use ringtmp_strategy::ring::plan::CutInsideChoice;
    let current = request.strategy.args.options.ring.cut_inside.clone();
    if request.strategy.name != "ring" {
        return current;
    }
    match current {
        Some(CutInsideChoice::At(cuts) | CutInsideChoice::Kept(cuts)) => {
            return Some(CutInsideChoice::Kept(cuts));
        }
        Some(CutInsideChoice::Planner(false)) => return Some(CutInsideChoice::Planner(false)),
        Some(CutInsideChoice::Planner(true)) | None => {}
    }
    let job = std::fs::read_to_string(out.join("job.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())?;
    let cuts: Vec<ringtmp_strategy::ring::plan::partition::CutInside> =
        serde_json::from_value(job["cuts_inside"].clone()).unwrap_or_default();
    Some(if cuts.is_empty() {
        CutInsideChoice::Planner(false)
    } else {
        CutInsideChoice::Kept(cuts)
    })
}

/// What the local nodes run on: each one's emulated card, CPU share and memory limit, checked
/// before anything starts.
struct LocalCluster {
    links: Vec<crate::links::Card>,
    cores: Vec<Option<f64>>,
    memory: Vec<Option<u64>>,
}

impl LocalCluster {
    fn check(request: &RunRequest) -> Result<Self> {
        let args = request.options();
        let nodes = request.strategy.nodes;
        let links = args.node_links(nodes)?;
        let cores = crate::cgroup::parse_node_cpu(
            args.cluster.node_cpu.as_deref().unwrap_or_default(),
            nodes,
        )?;
        let memory: Vec<Option<u64>> = if args.cluster.enforce_memory_limit.unwrap_or(false) {
            let limits = ringtmp_strategy::Cluster::local(nodes)
                .with_memory_limits(args.cluster.node_memory_limit.as_ref())
                .map_err(|e| UsageError(e.to_string()))?
                .memory_limits;
            if limits.iter().all(Option::is_none) {
                return Err(UsageError(
                    "--enforce-memory-limit needs --node-memory-limit (the limit to enforce)"
                        .into(),
                )
                .into());
            }
            limits
        } else {
            vec![None; nodes as usize]
        };
        crate::cgroup::NodeCgroups::check(&cores, &memory)?;
        Ok(Self {
            links,
            cores,
            memory,
        })
    }
}

/// Plans the job, writes it and the options for rank 0, and runs the local nodes once. Fault
/// injection: `--crash-rank` and `--freeze-rank` strike attempt 0; entry k of `--crash-plan`
/// strikes attempt k.
fn launch_once(request: &RunRequest, cluster: &LocalCluster, attempt: usize) -> Result<()> {
    let first = attempt == 0;
    let mut request = request.clone();
    let args = &request.options();
    let crash = crate::restart::crash_for(args, attempt)?;
    let nodes = request.strategy.nodes;
    let name = request.strategy.name.clone();
    let out = request.out();
    let (links, cores, memory) = (&cluster.links, &cluster.cores, &cluster.memory);
    // Check everything and plan here, before any process starts: a bad option is a usage error
    // (exit 2) of this command, and the plan printed is the one the nodes run.
    let data = load_dataset(args, first)?;
    let mut cfg = args.resolve_for(&data)?;
    let init = crate::init_from::convert(args, &cfg, &data)?;
    if init.is_some() {
        cfg.init_from = Some(crate::init_from::init_dir(&out));
    }
    let mut job = plan_here(args, cfg.clone(), &data, nodes, cores)?;
    drop(data);
    if request.faults.max_restarts > 0 {
        request = crate::restart::choose_checkpoints(request, &mut job, first);
    }
    crate::run_dir::prepare(&out, request.resume(), request.overwrite())?;
    if let (Some(init), Some(dir)) = (&init, &cfg.init_from) {
        init.write(dir)?;
    }
    let idle = match &job {
        ringtmp_strategy::Job::Ring(ring) if ring.idle_nodes > 0 => format!(
            " ({} in the ring; {} once it has formed)",
            nodes - ring.idle_nodes,
            if ring.idle_nodes == 1 {
                "the one it leaves idle leaves".to_string()
            } else {
                format!("the {} it leaves idle leave", ring.idle_nodes)
            }
        ),
        _ => String::new(),
    };
    eprintln!(
        "training with strategy {name} on {nodes} local node processes{idle}; output in {}",
        out.display()
    );
    // The nodes see the directory as prepared; they must not refuse or clear it again.
    let (config, plan) = crate::run_dir::write_run_files(&out, &request.node_options(), &job)?;
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
        node_args.extend(links[rank as usize].to_args());
        if args.faults.insecure_plaintext.unwrap_or(false) {
            node_args.push("--insecure-plaintext".into());
        }
        if let Some((_, after)) = crash.iter().find(|(r, _)| *r == rank) {
            node_args.extend(["--crash-after-ms".into(), after.to_string()]);
        }
        if first && args.faults.freeze_rank == Some(rank) {
            let after = args.faults.freeze_after_ms.unwrap_or(1000).to_string();
            node_args.extend(["--freeze-after-ms".into(), after]);
        }
        if first && args.faults.hang_rank == Some(rank) {
            let after = args.faults.hang_after_ms.unwrap_or(1000).to_string();
            node_args.extend(["--hang-after-ms".into(), after]);
        }
        node_args
    };
    let cgroups = std::cell::RefCell::new(crate::cgroup::NodeCgroups::default());
    let on_spawn = |rank: u32, pid: u32| -> Result<()> {
        if let Some(share) = cores[rank as usize] {
            cgroups.borrow_mut().limit(rank, pid, share)?;
            eprintln!("launcher: node {rank} runs under a CPU quota of {share} core(s)");
        }
        if let Some(bytes) = memory[rank as usize] {
            cgroups.borrow_mut().limit_memory(rank, pid, bytes)?;
            eprintln!(
                "launcher: node {rank} is held to {} MiB of memory",
                bytes >> 20
            );
        }
        Ok(())
    };
    let explain = |rank: u32| cgroups.borrow().explain(rank);
    let ended = crate::launcher::run(&crate::launcher::Launch {
        nodes,
        pin: args.cluster.pin.unwrap_or(false),
        verbose: args.output.verbose.unwrap_or(false),
        args: &node_args,
        expendable: &expendable,
        on_spawn: &on_spawn,
        explain: &explain,
        raw_rank0_stdout: false,
    });
    // Every node has exited: their groups go.
    drop(cgroups);
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

#[cfg(test)]
mod tests {
    use super::*;
    use ringtmp_strategy::ring::plan::CutInsideChoice;
    use ringtmp_strategy::ring::plan::partition::CutInside;

    // A restart keeps the failed attempt's cuts inside layers (or none), or the user's; other
    // strategies are left alone.
    #[test]
    fn a_restarted_ring_keeps_the_cuts_of_its_first_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let ring = |cut_inside: Option<CutInsideChoice>| {
            let mut args = TrainArgs {
                strategy: crate::args::StrategyArgs {
                    name: Some("ring".into()),
                    ..Default::default()
                },
                ..TrainArgs::default()
            };
            args.strategy.options.ring.cut_inside = cut_inside;
            args.resolve().unwrap()
        };
        std::fs::write(
            dir.path().join("job.json"),
            r#"{"partition": [], "cuts_inside": [{"layer": 9, "split": 320}]}"#,
        )
        .unwrap();
        let cut = vec![CutInside {
            layer: 9,
            split: 320,
        }];
        assert_eq!(
            kept_cuts(&ring(None), dir.path()),
            Some(CutInsideChoice::Kept(cut))
        );
        let told = ring(Some(CutInsideChoice::Planner(false)));
        assert_eq!(
            kept_cuts(&told, dir.path()),
            Some(CutInsideChoice::Planner(false))
        );
        // Cuts the user gave are kept as they are, boundaries only where they fit.
        let other = vec![CutInside {
            layer: 5,
            split: 64,
        }];
        let given = ring(Some(CutInsideChoice::At(other.clone())));
        assert_eq!(
            kept_cuts(&given, dir.path()),
            Some(CutInsideChoice::Kept(other))
        );
        // A first attempt without cuts: whole layers again.
        std::fs::write(dir.path().join("job.json"), r#"{"partition": []}"#).unwrap();
        assert_eq!(
            kept_cuts(&ring(None), dir.path()),
            Some(CutInsideChoice::Planner(false))
        );
        let ps = TrainArgs {
            strategy: crate::args::StrategyArgs {
                name: Some("ps".into()),
                ..Default::default()
            },
            ..TrainArgs::default()
        };
        assert_eq!(kept_cuts(&ps.resolve().unwrap(), dir.path()), None);
    }
}
