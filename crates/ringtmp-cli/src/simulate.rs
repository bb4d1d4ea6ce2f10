//! `ringtmp simulate`: what `ringtmp train` would do on a cluster this machine does not have.
//! The same options plan the same job; its nodes then run the strategy's own code on the
//! simulated network (`ringtmp_strategy::simulate`), with compute priced by a cost model measured
//! here (or read from a file measured on another machine) and tensors carried as sizes. Prints
//! the inputs, the assumptions and what `train` reports — samples/s, time per epoch, bytes per
//! node and link, compute and idle per node, the memory each node's model state needs — and
//! writes them to the run directory (`summary.json`, `simulation.json`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use ringtmp_strategy::Job;
use ringtmp_strategy::failures::{self, FailureModel};
use ringtmp_strategy::simulate::{ASSUMPTIONS, CostModel, Simulated, priced, simulate};

use crate::args::TrainArgs;
use crate::error::UsageError;
use crate::plan::{load_dataset, plan};

/// `ringtmp simulate` options: `train`'s, and where the cost model comes from.
#[derive(clap::Args, Clone, Debug)]
pub struct SimulateArgs {
    /// The run to simulate, as `ringtmp train` takes it (`--nodes` may exceed this machine).
    #[command(flatten)]
    pub train: TrainArgs,
    /// Cost model measured on another machine (`--save-cost-model` there) [default: measure
    /// this machine's].
    #[arg(long, value_name = "FILE")]
    pub cost_model: Option<PathBuf>,
    /// Writes the cost model used to FILE (to simulate this machine's nodes elsewhere).
    #[arg(long, value_name = "FILE")]
    pub save_cost_model: Option<PathBuf>,
    /// Compute for real on the simulated network instead of sizes only (slow; checks that a
    /// sizes-only run takes the same time and bytes).
    #[arg(long)]
    pub compute: bool,
    /// Nodes fail at this rate (failures per node and hour): one failure is injected into the
    /// strategy's own protocol to measure its recovery, then a long training (--horizon-hours)
    /// is followed through failures of every node, and the useful fraction of its time printed.
    #[arg(long, value_name = "RATE")]
    pub failures_per_node_hour: Option<f64>,
    /// With failures: seconds from a failure that ends the run to the restarted run training
    /// again from its newest checkpoint (the launcher's --max-restarts) [default: 60].
    #[arg(long, value_name = "SECONDS")]
    pub restart_seconds: Option<f64>,
    /// With failures: the speed each node writes its checkpoint at, MB/s [default: 50].
    #[arg(long, value_name = "MB_PER_S")]
    pub disk_mbyte_s: Option<f64>,
    /// With failures: length of the training the useful fraction is for, hours [default: 24].
    #[arg(long, value_name = "HOURS")]
    pub horizon_hours: Option<f64>,
    /// Each compute takes its priced time times a seeded factor in [1 − J, 1 + J]: real compute
    /// varies, and identical simulated nodes would otherwise stay in lockstep (0: exact).
    #[arg(long, value_name = "J", default_value_t = 0.05)]
    pub compute_jitter: f64,
}

/// The failure model `args` ask for (`None` without --failures-per-node-hour), checked.
fn failure_model(args: &SimulateArgs, seed: u64) -> Result<Option<FailureModel>> {
    let positive = |flag: &str, value: Option<f64>, default: f64| -> Result<f64> {
        match value {
            None => Ok(default),
            Some(v) if v.is_finite() && v > 0.0 => Ok(v),
            Some(v) => Err(UsageError(format!("{flag} {v}: expected a number > 0")).into()),
        }
    };
    let Some(rate) = args.failures_per_node_hour else {
        for (flag, given) in [
            ("--restart-seconds", args.restart_seconds.is_some()),
            ("--disk-mbyte-s", args.disk_mbyte_s.is_some()),
            ("--horizon-hours", args.horizon_hours.is_some()),
        ] {
            if given {
                return Err(UsageError(format!("{flag} needs --failures-per-node-hour")).into());
            }
        }
        return Ok(None);
    };
    if !(rate.is_finite() && rate >= 0.0) {
        return Err(UsageError(format!(
            "--failures-per-node-hour {rate}: expected a rate ≥ 0"
        ))
        .into());
    }
    Ok(Some(FailureModel {
        per_node_hour: rate,
        restart_seconds: positive("--restart-seconds", args.restart_seconds, 60.0)?,
        disk_bytes_per_second: positive("--disk-mbyte-s", args.disk_mbyte_s, 50.0)? * 1e6,
        horizon_seconds: positive("--horizon-hours", args.horizon_hours, 24.0)? * 3600.0,
        trials: 200,
        seed,
        checkpoint_seconds: None,
    }))
}

/// How much virtual time a simulation may take: a month.
const SIMULATION_TIME_LIMIT: Duration = Duration::from_secs(30 * 24 * 3600);

/// Options a simulated run cannot honour (its nodes hold sizes, not values): refused, not
/// dropped.
fn refuse_what_a_simulation_ignores(train: &TrainArgs) -> Result<()> {
    for (flag, given) in [
        (
            "--checkpoint-every",
            train.output.checkpoint_every.is_some(),
        ),
        ("--resume", train.output.resume.is_some()),
        ("--max-restarts", train.faults.max_restarts.is_some()),
        ("--pin", train.cluster.pin.is_some()),
        (
            "--node-memory-limit",
            train.cluster.node_memory_limit.is_some(),
        ),
    ] {
        if given {
            return Err(UsageError(format!(
                "{flag} does not apply to a simulated run (its nodes hold sizes, not values)"
            ))
            .into());
        }
    }
    Ok(())
}

/// `ringtmp simulate`.
pub fn run(args: &SimulateArgs) -> Result<()> {
    let train = args.train.merged()?;
    if train.strategy() == "local" {
        return Err(UsageError(
            "ringtmp simulate needs a distributed --strategy (ring, ps, allreduce, dpsgd, adpsgd)"
                .into(),
        )
        .into());
    }
    refuse_what_a_simulation_ignores(&train)?;
    let nodes = train.nodes();
    let failure_model = failure_model(args, train.training.seed.unwrap_or(42))?;
    // A simulated node has its own cores: one thread each unless told otherwise (the cost
    // model is measured with the same count).
    let mut train = train;
    train.training.threads = Some(train.training.threads.unwrap_or(1));
    let data = load_dataset(&train, true)?;
    if train.output.eval_every.is_none() {
        // Evaluations take no virtual time (see the assumptions): none but the final one.
        train.output.eval_every = Some(0);
    }
    let mut cfg = train.resolve_for(&data)?;
    // A simulation writes no model (its tensors carry sizes, not values).
    cfg.checkpoint_every = 0;
    // A simulated node fails only where a fault says so, and its neighbours then see it fail: a
    // receive timeout would only cut a slow cluster's legitimate waits (an AD-PSGD worker whose
    // grant is used up waits minutes of virtual time at 100 Mbit/s). Waits are bounded by the
    // simulation's time limit instead, unless --recv-timeout says otherwise.
    if train.faults.recv_timeout.is_none() {
        cfg.recv_timeout_secs = SIMULATION_TIME_LIMIT.as_secs_f64();
    }
    if train.output.out.is_none() {
        cfg.out = PathBuf::from(format!("runs/simulate-{}-n{nodes}", train.strategy()));
    }
    crate::run_dir::prepare(&cfg.out, None, train.output.overwrite.unwrap_or(false))?;
    let job = plan(&train, cfg, &data, nodes)?;
    // As `train` writes it (compare reads it beside the summary).
    let plan_path = job.spec().config.out.join("job.json");
    std::fs::create_dir_all(&job.spec().config.out)?;
    std::fs::write(&plan_path, serde_json::to_string_pretty(&job)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", plan_path.display()))?;
    let spec = job.spec();
    let layers = spec.layers()?;
    let threads = spec.config.threads.max(1);
    let rows = match &job {
        Job::Ring(j) => spec.config.batch_size.div_ceil(j.micro_batches.max(1)),
        _ => spec.config.batch_size,
    };
    let costs = match &args.cost_model {
        Some(path) => {
            let costs = CostModel::load(path)?;
            costs.check_fits(&spec.config.model.name, &layers)?;
            costs
        }
        None => {
            eprintln!(
                "measuring the cost model: {} layers of {} at {rows} rows, {threads} thread(s)",
                layers.len(),
                spec.config.model.name
            );
            crate::plan::init_threads(threads)?;
            CostModel::measure(
                &spec.config.model.name,
                &layers,
                &spec.config.optimizer,
                rows,
                threads,
                5,
            )
        }
    };
    if let Some(path) = &args.save_cost_model {
        costs.save(path)?;
        eprintln!("cost model written to {}", path.display());
    }
    let mut sim = priced(spec.config.seed, costs.clone(), !args.compute);
    if !(0.0..1.0).contains(&args.compute_jitter) {
        return Err(UsageError(format!(
            "--compute-jitter {}: expected a fraction in [0, 1)",
            args.compute_jitter
        ))
        .into());
    }
    sim.compute_jitter = args.compute_jitter;
    let links = train.node_links(nodes)?;
    sim.latency = Duration::from_secs_f64(links[0].latency_ms / 1e3);
    if links.iter().any(|l| *l != links[0]) {
        eprintln!(
            "note: the simulated network gives every link the same latency ({} ms); per-node \
             bandwidths from --link are kept",
            links[0].latency_ms
        );
    }
    for (rank, card) in links.iter().enumerate() {
        if let Some(mbit) = card.mbit {
            sim.node_bandwidth_bps
                .insert(rank as u32, (mbit * 1e6).round() as u64);
        }
    }
    let quotas = crate::cgroup::parse_node_cpu(
        train.cluster.node_cpu.as_deref().unwrap_or_default(),
        nodes,
    )?;
    for (rank, quota) in quotas.iter().enumerate() {
        if let Some(cores) = quota {
            // A quota of `cores` cores for a node whose cost model ran on `threads` of them.
            sim.node_speed
                .insert(rank as u32, (cores / threads as f64).min(1.0));
        }
    }
    // Only logits keep their values (the loss reads them): an evaluation chunk's (250 rows) or a
    // batch's, whichever is larger, of every position for a language model. Everything larger
    // travels as sizes, so no node's buffers ever hold a model's worth of values.
    sim.phantom_inline_values = 250.max(spec.config.batch_size) * spec.classes * spec.positions();
    // A frozen simulated node is seen dead after this much silence, as on real links a peer
    // that says nothing for the receive timeout is given up on.
    sim.peer_timeout = Duration::from_secs_f64(
        train
            .faults
            .recv_timeout
            .unwrap_or(ringtmp_strategy::DEFAULT_RECV_TIMEOUT_SECS),
    );
    sim.time_limit = SIMULATION_TIME_LIMIT;
    print_inputs(&costs, &sim, nodes, &job);
    let ran = simulate(&job, nodes, &data, sim.clone())?;
    for failure in &ran.expendable_failures {
        eprintln!("simulate: {failure} (expendable)");
    }
    print_results(&ran, &job, nodes);
    let failures = failure_model
        .as_ref()
        .map(|model| study_failures(model, &job, nodes, &data, &sim, &ran));
    let record = serde_json::json!({
        "nodes": nodes,
        "strategy": job.name(),
        "phantom": !args.compute,
        "assumptions": ASSUMPTIONS,
        "cost_model": costs,
        "latency_seconds": sim.latency.as_secs_f64(),
        "node_bandwidth_bps": sim.node_bandwidth_bps,
        "node_speed": sim.node_speed,
        "virtual_seconds": ran.virtual_seconds,
        "wall_seconds": ran.wall_seconds,
        "messages": ran.messages,
        "most_alive": ran.most_alive,
        "samples_per_second": ran.summary.samples_per_second,
        "train_seconds": ran.summary.train_seconds,
        "total_bytes_sent": ran.summary.total_bytes_sent,
        "failures": failures,
    });
    let path = job.spec().config.out.join("simulation.json");
    std::fs::write(&path, serde_json::to_string_pretty(&record)? + "\n")
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    println!("written: {} and summary.json beside it", path.display());
    Ok(())
}

/// Injects one failure into the protocol, follows a long training through failures, prints
/// what it found and returns it for simulation.json.
fn study_failures(
    model: &FailureModel,
    job: &Job,
    nodes: u32,
    data: &ringtmp_data::Dataset,
    sim: &ringtmp_transport::sim::SimConfig,
    ran: &Simulated,
) -> serde_json::Value {
    let probe = failures::probe_recovery(job, nodes, data, sim.clone(), ran);
    let expendable = (0..nodes).filter(|r| job.expendable(*r)).count() as u32;
    let (tolerated, cost) = match &probe {
        Some(p) if p.recovered => (expendable, p.extra_seconds),
        _ => (0, 0.0),
    };
    match &probe {
        Some(p) if p.recovered => println!(
            "failure of rank {} at {:.1} s (injected into the protocol): recovered, the run took \
             {:.1} s longer; {expendable} of {nodes} nodes can fail without a restart",
            p.rank, p.at_seconds, p.extra_seconds
        ),
        Some(p) => println!(
            "failure of rank {} at {:.1} s (injected into the protocol): the run ended ({}); \
             every failure needs a restart",
            p.rank,
            p.at_seconds,
            p.error.as_deref().unwrap_or("?")
        ),
        None => println!("{}: every node's failure needs a restart", job.name()),
    }
    let state = ran
        .summary
        .per_node
        .iter()
        .map(|n| n.param_bytes + n.optimizer_bytes)
        .max()
        .unwrap_or(0);
    let study = failures::study(model, nodes, tolerated, cost, state);
    println!(
        "with {} failures per node-hour over {:.0} h ({} trials): useful fraction {:.1}% \
         (5–95%: {:.1}–{:.1}%), {:.2} failures and {:.2} restarts an hour; checkpoint every \
         {:.0} s of training ({:.2} s to write {:.1} MB), restart {:.0} s",
        model.per_node_hour,
        model.horizon_seconds / 3600.0,
        model.trials,
        study.useful_fraction * 100.0,
        study.useful_fraction_p05 * 100.0,
        study.useful_fraction_p95 * 100.0,
        study.failures_per_hour,
        study.restarts_per_hour,
        study.checkpoint_interval_seconds,
        study.checkpoint_write_seconds,
        state as f64 / 1e6,
        model.restart_seconds
    );
    println!("assumes: {}", failures::ASSUMPTIONS);
    serde_json::json!({
        "model": model,
        "probe": probe,
        "study": study,
        "assumptions": failures::ASSUMPTIONS,
    })
}

fn print_inputs(costs: &CostModel, sim: &ringtmp_transport::sim::SimConfig, nodes: u32, job: &Job) {
    let spec = job.spec();
    let pass_ms = costs.step_seconds(costs.rows, 0) * 1e3;
    println!(
        "simulating {} on {nodes} nodes ({}): model {}, batch {}, {} step(s)",
        job.name(),
        if sim.phantom {
            "sizes only"
        } else {
            "computing"
        },
        spec.config.model.name,
        spec.config.batch_size,
        spec.total_steps
    );
    println!(
        "cost model: {} ({} thread(s)): forward + backward of the whole model {pass_ms:.2} ms \
         per {} rows; update {:.2} ns/parameter; element-wise {:.3} ns/value",
        costs.machine,
        costs.threads,
        costs.rows,
        costs.update_seconds_per_param * 1e9,
        costs.elementwise_seconds_per_value * 1e9
    );
    let bandwidths: std::collections::BTreeSet<u64> =
        sim.node_bandwidth_bps.values().copied().collect();
    println!(
        "network: {} per node, {} ms one-way latency; node speeds {}",
        match bandwidths.len() {
            0 => "unlimited bandwidth".to_string(),
            1 => format!(
                "{} Mbit/s",
                bandwidths.first().copied().unwrap_or(0) as f64 / 1e6
            ),
            _ => "per-node bandwidths (--link)".to_string(),
        },
        sim.latency.as_secs_f64() * 1e3,
        if sim.node_speed.is_empty() {
            "1 (as measured)".to_string()
        } else {
            format!("{:?}", sim.node_speed)
        }
    );
    println!("assumes: {ASSUMPTIONS}");
}

fn print_results(ran: &Simulated, job: &Job, nodes: u32) {
    let s = &ran.summary;
    let spec = job.spec();
    let epoch_samples = spec.steps_per_epoch as f64 * (s.samples as f64 / s.steps.max(1) as f64);
    println!(
        "simulated: {:.0} samples/s; {:.1} s of training for {} samples ({} steps); an epoch \
         ({:.0} samples) would take {:.1} s",
        s.samples_per_second,
        s.train_seconds,
        s.samples,
        s.steps,
        epoch_samples,
        epoch_samples / s.samples_per_second.max(f64::MIN_POSITIVE)
    );
    println!(
        "bytes sent {} ({:.0} per sample); {:.1} s of virtual time in {:.1} s on this machine, \
         {} messages, at most {} of the {nodes} nodes alive at once",
        s.total_bytes_sent,
        s.bytes_per_sample,
        ran.virtual_seconds,
        ran.wall_seconds,
        ran.messages,
        ran.most_alive
    );
    println!(
        "{:>5} {:<7} {:>11} {:>11} {:>11} {:>9} {:>9} {:>7}",
        "rank", "role", "params", "state MB", "sent", "compute", "idle", "bubble"
    );
    let shown: Vec<&ringtmp_metrics::NodeSummary> = if nodes <= 16 {
        s.per_node.iter().collect()
    } else {
        // First and last few of a large cluster; the rest is in summary.json.
        let n = s.per_node.len();
        s.per_node
            .iter()
            .enumerate()
            .filter(|(i, _)| *i < 4 || *i + 4 >= n)
            .map(|(_, p)| p)
            .collect()
    };
    for n in shown {
        println!(
            "{:>5} {:<7} {:>11} {:>11.1} {:>11} {:>8.2}s {:>8.2}s {:>6.1}%",
            n.rank,
            n.role,
            n.params,
            (n.param_bytes + n.optimizer_bytes + n.peak_stash_bytes) as f64 / 1e6,
            n.bytes_sent,
            n.compute_seconds,
            n.idle_seconds,
            n.bubble_fraction * 100.0
        );
    }
    if nodes > 16 {
        println!(
            "  … {} nodes in all (every one in summary.json)",
            s.per_node.len()
        );
    }
    println!(
        "state MB: parameters, optimizer state and stashed activations a node must hold \
         (its process needs more). accuracy is not simulated."
    );
}
