//! A node of a parameter-server run: servers run their shard and gate, workers train on their
//! share of every global batch, and server 0 collects every node's report into `summary.json`.

use std::time::Instant;

use anyhow::{Context, Result};
use ringtmp_data::Dataset;
use ringtmp_metrics::{NodeSummary, Summary, resources};
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::param_server::driver::{PsJob, run_server, run_worker};
use ringtmp_transport::Transport;
use ringtmp_wire::{Control, Message};

use crate::args::TrainArgs;
use crate::node::JobArgs;

/// Runs this node's part of a parameter-server job. `master` is rank 0's data and configuration.
pub fn run(
    job: &PsJob,
    rank: u32,
    master: Option<(Dataset, TrainConfig)>,
    job_args: &JobArgs,
    net: &mut dyn Transport,
) -> Result<()> {
    let started = Instant::now();
    if (rank as usize) < job.servers {
        let outcome = run_server(job, rank as usize, net)?;
        let mut own = base_summary(rank, "server", outcome.params.len() as u64, net);
        own.staleness_histogram = outcome.staleness;
        own.dropped_workers = outcome.dropped.iter().map(|d| d.rank).collect();
        own.optimizer_bytes = own.param_bytes * optimizer_copies(job);
        if rank != 0 {
            return report(net, &own);
        }
        // Server 0: every other server's and every remaining worker's report.
        let expected = job.servers - 1 + job.workers - outcome.dropped.len();
        let mut per_node = vec![own];
        for doc in &outcome.reports {
            per_node.push(serde_json::from_str(doc).context("a node's report")?);
        }
        while per_node.len() < expected + 1 {
            match net.recv(std::time::Duration::from_secs_f64(
                job.spec.recv_timeout_secs,
            ))? {
                (_, Message::Control(Control::Report { nodes })) => {
                    for doc in nodes {
                        per_node.push(serde_json::from_str(&doc).context("a node's report")?);
                    }
                }
                (from, _) => anyhow::bail!(
                    "server 0: unexpected message from rank {from} while collecting reports"
                ),
            }
        }
        per_node.sort_by_key(|n| n.rank);
        // Each worker's staleness as server 0's gate observed it.
        for node in per_node.iter_mut().filter(|n| n.role == "worker") {
            if let Some(h) = outcome
                .worker_staleness
                .get(node.rank as usize - job.servers)
            {
                node.staleness_histogram = h.clone();
            }
        }
        let Some((_, cfg)) = master else {
            anyhow::bail!("rank 0 has no configuration")
        };
        let mut summary = summarize(job, &cfg, per_node, started.elapsed().as_secs_f64());
        summary.dropped_nodes = outcome.dropped.clone();
        let path = cfg.out.join("summary.json");
        std::fs::create_dir_all(&cfg.out)?;
        summary
            .write(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        crate::train::print_summary(&summary, &cfg.out);
        return Ok(());
    }
    // A worker: its data comes from the same options file rank 0 read.
    let path = job_args
        .config
        .clone()
        .context("a parameter-server worker needs --config FILE to read its data")?;
    let train_args = TrainArgs {
        config: Some(path),
        ..Default::default()
    }
    .merged()?;
    let data = crate::train::load_dataset(&train_args, false)?;
    crate::train::init_threads(job.spec.threads)?;
    let w = rank as usize - job.servers;
    let speed = job.node_speeds.get(rank as usize).copied().unwrap_or(1.0);
    // Worker 0 evaluates its replica at the first pull at or past every `eval_every`-th global
    // iteration and every epoch end (under dynamic assignment its units skip iterations), on a
    // clock that excludes the evaluations themselves.
    let eval_every = train_args.eval_every.unwrap_or(200);
    let (mut evaluations, mut eval_seconds) = (Vec::new(), 0.0f64);
    let clock = Instant::now();
    let mut last = job.first_step();
    let mut evaluate = |t: u64, stage: &mut ringtmp_model::Stage| -> ringtmp_strategy::Result<()> {
        let crossed = |every: u64| every > 0 && t / every > last / every;
        let due = crossed(job.spec.steps_per_epoch) || crossed(eval_every);
        last = last.max(t);
        if w == 0 && due {
            let started = Instant::now();
            let (accuracy, _) = ringtmp_strategy::local::evaluate(stage, &data.test, data.classes)?;
            eval_seconds += started.elapsed().as_secs_f64();
            evaluations.push((t, accuracy, clock.elapsed().as_secs_f64() - eval_seconds));
            eprintln!("eval iteration {t}: test accuracy {:.2}%", accuracy * 100.0);
        }
        Ok(())
    };
    let (outcome, mut stage) = run_worker(job, w, &data, speed, net, &mut evaluate)?;
    // The final replica (the last pull's parameters) is an evaluation point too: a run that
    // reaches the target only at its end has reached it, at that time.
    let finished_at = clock.elapsed().as_secs_f64() - eval_seconds;
    let mut own = base_summary(rank, "worker", stage.params().len() as u64, net);
    own.iterations = outcome.iterations;
    own.wait_seconds = outcome.wait_seconds;
    own.compute_seconds = outcome.compute_seconds;
    own.idle_seconds = outcome.wait_seconds;
    own.final_epoch_loss_sum = outcome.final_epoch_loss_sum;
    own.final_epoch_units = outcome.final_epoch_units;
    if w == 0 {
        let (accuracy, _) =
            ringtmp_strategy::local::evaluate(&mut stage, &data.test, data.classes)?;
        own.test_accuracy = Some(accuracy);
        // The final replica holds every iteration of the run (under BSP exactly; otherwise up
        // to the pushes still in flight when the work ran out).
        let end = job.spec.total_steps;
        if evaluations.last().map(|e| e.0) != Some(end) {
            evaluations.push((end, accuracy, finished_at));
        }
        own.evaluations = evaluations;
    }
    report(net, &own)
}

fn optimizer_copies(job: &PsJob) -> u64 {
    match job.spec.optimizer {
        ringtmp_model::OptimizerConfig::Sgd { .. } => 1,
        ringtmp_model::OptimizerConfig::Adam { .. } => 2,
    }
}

fn base_summary(rank: u32, role: &str, params: u64, net: &dyn Transport) -> NodeSummary {
    let links = net.stats();
    NodeSummary {
        rank,
        role: role.into(),
        params,
        param_bytes: params * 4,
        peak_rss_bytes: resources::peak_rss_bytes().unwrap_or(0),
        bytes_sent: links.iter().map(|l| l.bytes_sent).sum(),
        bytes_received: links.iter().map(|l| l.bytes_received).sum(),
        messages_sent: links.iter().map(|l| l.messages_sent).sum(),
        cpu_seconds: resources::cpu_seconds(),
        links: links
            .iter()
            .map(|l| (l.peer, l.bytes_sent, l.bytes_received))
            .collect(),
        ..Default::default()
    }
}

fn report(net: &mut dyn Transport, own: &NodeSummary) -> Result<()> {
    let doc = serde_json::to_string(own)?;
    net.send(0, Message::Control(Control::Report { nodes: vec![doc] }))?;
    Ok(())
}

fn summarize(job: &PsJob, cfg: &TrainConfig, per_node: Vec<NodeSummary>, wall: f64) -> Summary {
    let samples: u64 = per_node
        .iter()
        .filter(|n| n.role == "worker")
        .map(|n| n.iterations * job.spec.batch_size as u64)
        .sum();
    let total_bytes_sent: u64 = per_node.iter().map(|n| n.bytes_sent).sum();
    let accuracy = per_node.iter().find_map(|n| n.test_accuracy).unwrap_or(0.0);
    let evaluations: Vec<(u64, f64, f64)> = per_node
        .iter()
        .flat_map(|n| n.evaluations.clone())
        .collect();
    let reached = evaluations
        .iter()
        .find(|(_, a, _)| *a >= cfg.target_accuracy)
        .copied();
    let best = evaluations
        .iter()
        .map(|(_, a, _)| *a)
        .fold(accuracy, f64::max);
    let model_params = per_node
        .iter()
        .filter(|n| n.role == "server")
        .map(|n| n.params)
        .sum();
    Summary {
        strategy: "ps".into(),
        schedule: None,
        consistency: Some(job.consistency.name()),
        nodes: (job.servers + job.workers) as u32,
        model: job.spec.model.name.clone(),
        model_params,
        dataset: cfg.dataset.clone(),
        epochs: cfg.epochs,
        batch_size: job.spec.batch_size as u32,
        micro_batches: 1,
        seed: job.spec.seed,
        optimizer: match job.spec.optimizer {
            ringtmp_model::OptimizerConfig::Sgd { .. } => "sgd".into(),
            ringtmp_model::OptimizerConfig::Adam { .. } => "adam".into(),
        },
        lr: job.spec.lr,
        threads: job.spec.threads as u32,
        steps: job.spec.total_steps,
        samples,
        // The mean loss of the units of the final epoch, over every worker that computed some.
        final_train_loss: {
            let units: u64 = per_node.iter().map(|n| n.final_epoch_units).sum();
            let sum: f64 = per_node.iter().map(|n| n.final_epoch_loss_sum).sum();
            if units == 0 {
                f64::NAN
            } else {
                sum / units as f64
            }
        },
        final_test_accuracy: accuracy,
        best_test_accuracy: best,
        target_accuracy: cfg.target_accuracy,
        time_to_target_seconds: reached.map(|(_, _, t)| t),
        steps_to_target: reached.map(|(s, _, _)| s),
        wall_seconds: wall,
        train_seconds: wall,
        samples_per_second: samples as f64 / wall.max(1e-9),
        total_bytes_sent,
        bytes_per_sample: total_bytes_sent as f64 / samples.max(1) as f64,
        theoretical_bubble_fraction: None,
        partition: Vec::new(),
        dropped_nodes: Vec::new(),
        per_node,
    }
}
