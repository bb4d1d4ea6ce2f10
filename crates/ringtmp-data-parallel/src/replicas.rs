//! What the data-parallel strategies share beside their loop: every node is a worker with a
//! whole replica that trains on its share of each global batch, so they plan their run, keep
//! their clocks, checkpoint the model and report a worker the same way.

use std::collections::BTreeSet;

use ringtmp_data::{BatchPlan, Dataset, shard};
use ringtmp_metrics::NodeSummary;
use ringtmp_model::{Optimizer, Pass, Stage, checkpoint};
use ringtmp_transport::Transport;

use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, PlanReport};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::{ResumePoint, RunSpec};

/// The spec of a data-parallel run of `strategy` on every node of `cluster`: a worker's share of
/// each global batch is `config.batch_size`; threads are shared out when the user chose none;
/// the default rate and warm-up scale with the workers ([`ringtmp_contract::batch_scaling`]: a step
/// averages W batches); a resume point must hold the same global batch.
pub fn plan_spec(
    strategy: &str,
    config: TrainConfig,
    cluster: &Cluster,
    data: &Dataset,
    report: &mut PlanReport,
) -> Result<(RunSpec, usize)> {
    plan_spec_with(strategy, config, cluster, data, report, true)
}

/// [`plan_spec`], with the default rate and warm-up scaled for the workers' averaged batches
/// only when `averaged` (a step of DiLoCo's inner loop is one worker's batch alone).
pub fn plan_spec_with(
    strategy: &str,
    mut config: TrainConfig,
    cluster: &Cluster,
    data: &Dataset,
    report: &mut PlanReport,
    averaged: bool,
) -> Result<(RunSpec, usize)> {
    let workers = cluster.nodes as usize;
    if workers < 2 {
        return Err(Error::Config(format!(
            "--strategy {strategy} needs --nodes of at least 2 (one worker is --strategy local)"
        )));
    }
    let layers = ringtmp_contract::layers_for(&config.model, data)?;
    let floor = ringtmp_contract::memory_floor::whole_replica(&layers, &config.optimizer);
    ringtmp_contract::memory_floor::check(strategy, &floor, 0..workers, cluster)?;
    if cluster.threads.is_none() {
        config.threads = (cluster.cores / workers).max(1);
    }
    if let Some(note) = ringtmp_contract::batch_scaling::scale_defaults(
        &mut config,
        if averaged { workers } else { 1 },
        ringtmp_contract::batch_scaling::Updates::Synchronous,
    ) {
        report.note(format!("{strategy}: {note}"));
    }
    let global = config.batch_size * workers;
    let resume = config.resume.clone();
    let mut spec = RunSpec::new(config, data, global)?;
    if let Some(path) = &resume {
        let global_cfg = TrainConfig {
            batch_size: global,
            ..spec.config.clone()
        };
        let (dir, manifest) = ringtmp_contract::resume::check_resume(path, &global_cfg, data)?;
        spec.resume_from = Some(ResumePoint {
            dir: std::path::absolute(&dir).unwrap_or(dir),
            step: manifest.step.min(spec.total_steps),
        });
    }
    spec.config.out = std::path::absolute(&spec.out).unwrap_or_else(|_| spec.out.clone());
    Ok((spec, workers))
}

/// A worker's share of one global batch and its forward pass: gathers share `rank` of `n` of
/// step `step`'s batch (near-equal contiguous shares, as [`shard`] cuts them), runs the forward
/// pass and the loss, and leaves the loss's gradient (of the mean over the share) in `dlogits`.
/// Returns the share's mean loss.
pub fn forward_share(
    spec: &RunSpec,
    plan: &mut BatchPlan,
    data: &Dataset,
    stage: &mut Stage,
    rank: u32,
    n: usize,
    step: u64,
    buffers: &mut ShareBuffers,
) -> Result<f64> {
    let epoch = step / spec.steps_per_epoch;
    let batch = plan
        .batch(epoch, (step % spec.steps_per_epoch) as usize)
        .to_vec();
    let mine = shard(&batch, rank as usize, n)?;
    data.train.gather(mine, &mut buffers.x, &mut buffers.y);
    // Where the share starts in the global batch (per-row randomness, e.g. dropout, is a
    // function of the row's place in the batch, so any split draws the same masks).
    let (base, extra) = (batch.len() / n, batch.len() % n);
    let pass = Pass {
        train: true,
        seed: spec.seed,
        step,
        row_offset: rank as usize * base + (rank as usize).min(extra),
    };
    // Labels: one per example, or one per position of a window.
    let rows = buffers.y.len();
    let logits = stage.forward(0, &buffers.x, mine.len(), &pass)?;
    buffers.dlogits.resize(logits.len(), 0.0);
    let scored = spec.objective.score(
        logits,
        &buffers.y,
        spec.classes,
        1.0 / rows as f32,
        &mut buffers.dlogits,
    )?;
    Ok(scored.loss_sum / rows as f64)
}

/// The buffers a worker's share of a batch is gathered and scored in (reused every step).
#[derive(Default)]
pub struct ShareBuffers {
    /// Inputs.
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<u32>,
    /// The loss's gradient with respect to the logits.
    pub dlogits: Vec<f32>,
}

/// Rank 0's recorder of a data-parallel run (with `extra` in its start event), after telling
/// `on_event` the run has started; `None` on every other rank.
pub fn open_recorder(
    spec: &RunSpec,
    strategy: &str,
    rank: u32,
    params: usize,
    extra: serde_json::Value,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<Option<ringtmp_contract::recorder::RunRecorder>> {
    if rank != 0 {
        return Ok(None);
    }
    let recorder = ringtmp_contract::recorder::RunRecorder::open(spec, strategy, extra)?;
    on_event(&ringtmp_contract::Event::Started {
        total_steps: spec.total_steps,
        first_step: spec.first_step(),
        params,
        stage_params: Vec::new(),
    });
    Ok(Some(recorder))
}

/// Checks the per-worker speeds of a job from a file or the network.
pub fn check_speeds(speeds: &[f64], workers: usize) -> Result<()> {
    if speeds.len() != workers
        || speeds
            .iter()
            .any(|s| !(s.is_finite() && *s > 0.0 && *s <= 1.0))
    {
        return Err(Error::Config(format!(
            "invalid job: node speeds {speeds:?} for {workers} workers (each in (0, 1])"
        )));
    }
    Ok(())
}

/// What a worker measured, for its report.
pub struct WorkerClock {
    /// Seconds on the training clock.
    pub train_seconds: f64,
    /// Of which computing.
    pub compute_seconds: f64,
    /// Of which waiting for the other workers (reduction, gossip).
    pub wait_seconds: f64,
    /// Iterations done.
    pub iterations: u64,
    /// Examples of the shares this worker trained on, where the run's count is the workers'
    /// sum (DiLoCo; 0 elsewhere).
    pub samples: u64,
}

/// A worker's report: its replica, traffic, memory and clocks.
pub fn worker_summary(
    rank: u32,
    stage: &Stage,
    optimizer: &Optimizer,
    net: &dyn Transport,
    clock: &WorkerClock,
) -> NodeSummary {
    let stats = net.stats();
    let params = stage.params().len() as u64;
    let idle = (clock.train_seconds - clock.compute_seconds).max(0.0);
    let os = ringtmp_contract::machine::ProcessReadings::of(net.clock().as_ref());
    NodeSummary {
        rank,
        role: "worker".into(),
        params,
        param_bytes: params * 4,
        optimizer_bytes: optimizer.state_bytes() as u64,
        peak_rss_bytes: os.peak_rss_bytes,
        bytes_sent: stats.iter().map(|l| l.bytes_sent).sum(),
        bytes_received: stats.iter().map(|l| l.bytes_received).sum(),
        messages_sent: stats.iter().map(|l| l.messages_sent).sum(),
        compute_seconds: clock.compute_seconds,
        idle_seconds: idle,
        wait_seconds: clock.wait_seconds,
        cpu_seconds: os.cpu_seconds,
        steal_seconds: os.steal_seconds,
        throttled_seconds: os.throttled_seconds,
        iterations: clock.iterations,
        samples: clock.samples,
        bubble_fraction: if clock.train_seconds > 0.0 {
            idle / clock.train_seconds
        } else {
            0.0
        },
        links: stats
            .iter()
            .map(|l| (l.peer, l.bytes_sent, l.bytes_received))
            .collect(),
        ..Default::default()
    }
}

/// Every worker's report to rank 0 at the end of a run: the others send theirs; rank 0 returns
/// its own and those of `members` in rank order. A member that dies first is skipped (named in
/// a [`ringtmp_contract::Event::Notice`]); rank 0's own failure, or anything else, is an error.
pub fn gather_reports(
    net: &mut dyn Transport,
    rank: u32,
    members: &[u32],
    own: NodeSummary,
    timeout: std::time::Duration,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<Option<Vec<NodeSummary>>> {
    use ringtmp_wire::{Control, Message};
    if rank != 0 {
        let doc = serde_json::to_string(&own).map_err(|e| Error::Config(e.to_string()))?;
        net.send(0, Message::Control(Control::Report { nodes: vec![doc] }))?;
        return Ok(None);
    }
    let mut reports = vec![own];
    let mut gone = std::collections::BTreeSet::new();
    for &r in members.iter().filter(|r| **r != 0) {
        while !gone.contains(&r) {
            match net.recv_from(r, timeout) {
                Ok(Message::Control(Control::Report { nodes })) => {
                    for doc in nodes {
                        reports.push(serde_json::from_str(&doc).map_err(|e| {
                            Error::Config(format!("rank {r}'s report is not valid: {e}"))
                        })?);
                    }
                    break;
                }
                Ok(_) => {
                    return Err(Error::protocol(
                        "report",
                        net,
                        r,
                        "message instead of its report",
                    ));
                }
                Err(e) => match e.failed_peer() {
                    Some(dead) if dead != 0 => {
                        on_event(&ringtmp_contract::Event::Notice {
                            text: format!("rank {dead} left before its final report ({e})"),
                        });
                        gone.insert(dead);
                    }
                    _ => return Err(e.into()),
                },
            }
        }
    }
    reports.sort_by_key(|p| p.rank);
    Ok(Some(reports))
}

/// What a data-parallel run did, for its summary.
pub struct RunTotals {
    /// Parameters of the model.
    pub params: u64,
    /// Global steps completed.
    pub steps: u64,
    /// Samples trained on.
    pub samples: u64,
    /// Whether the run's samples are the sum of the workers' reports instead (DiLoCo, whose
    /// workers may skip steps: rank 0 cannot count them; a worker that died before its report
    /// is not counted).
    pub samples_from_reports: bool,
    /// Wall-clock seconds of the run.
    pub wall_seconds: f64,
    /// Seconds on the training clock.
    pub train_seconds: f64,
}

/// Rank 0's summary of a data-parallel run of `strategy` on `nodes` nodes: the recorder's fields,
/// the totals, and the traffic of every node's report; the caller adds what is its own.
pub fn run_summary(
    recorder: &ringtmp_contract::recorder::RunRecorder,
    strategy: &str,
    nodes: u32,
    totals: &RunTotals,
    per_node: Vec<NodeSummary>,
) -> ringtmp_metrics::Summary {
    let total_bytes_sent: u64 = per_node.iter().map(|p| p.bytes_sent).sum();
    // The whole run's clocks and samples (a restarted run's earlier attempts included); the
    // bytes are this attempt's nodes', so they are per this attempt's samples.
    let carried = recorder.carried();
    let attempt_samples = if totals.samples_from_reports {
        per_node.iter().map(|p| p.samples).sum()
    } else {
        totals.samples
    };
    let (train_seconds, samples) = recorder.run_figures(totals.train_seconds, attempt_samples);
    ringtmp_metrics::Summary {
        model_params: totals.params,
        steps: totals.steps,
        samples,
        wall_seconds: carried.wall_seconds + totals.wall_seconds,
        train_seconds,
        samples_per_second: samples as f64 / train_seconds.max(1e-9),
        total_bytes_sent,
        bytes_per_sample: total_bytes_sent as f64 / attempt_samples.max(1) as f64,
        per_node,
        ..recorder.summary(strategy, nodes)
    }
}

/// Writes `stage` (a whole model) as the checkpoint of `step` of a data-parallel run of
/// `workers` (its data order is that of the global batch), atomically, with each worker's own
/// model from `replicas` (rank, parameters) beside it; prunes old ones.
pub fn write_model(
    spec: &ringtmp_contract::RunSpec,
    workers: usize,
    strategy: &str,
    stage: &Stage,
    optimizer: &Optimizer,
    step: u64,
    replicas: &[(u32, &[f32])],
) -> Result<std::path::PathBuf> {
    let dir = spec.checkpoint_dir(step);
    let written = (|| -> Result<()> {
        let file = checkpoint::write_stage(&dir, "stage-0.safetensors", stage, optimizer)?;
        let replicas = replicas
            .iter()
            .map(|(rank, params)| {
                checkpoint::write_params(
                    &dir,
                    &format!("replica-{rank}.safetensors"),
                    stage,
                    params,
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // The data order is that of the global batch.
        let manifest = spec.manifest(
            strategy,
            step,
            spec.batch_size * workers,
            vec![(0, stage.layers().len())],
            vec![file],
            replicas,
        );
        checkpoint::write_manifest(&dir, &manifest)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    written?;
    if let Some(keep) = spec.keep_checkpoints {
        checkpoint::retain_newest(&spec.out.join("checkpoints"), keep)?;
    }
    Ok(dir)
}

/// What a worker returns: its replica, and on rank 0 the run's summary.
pub struct WorkerOutcome {
    /// The worker's final parameters (the same bits on every worker, unless its strategy's
    /// workers keep models of their own, as the gossip family's do).
    pub stage: Stage,
    /// Rank 0's summary of the run.
    pub summary: Option<ringtmp_metrics::Summary>,
}

/// Every other worker: an elastic ring re-formed around the dead joins any two survivors, and
/// rank 0 may hand any of them its state (an idle link costs a heartbeat).
pub fn every_other(rank: u32, world: u32) -> BTreeSet<u32> {
    (0..world).filter(|r| *r != rank).collect()
}

/// A gossip graph's links `near` of `rank`, with rank 0 linked to every worker (it coordinates
/// the pairs, or gathers the models for the consensus).
pub fn with_rank_zero(mut near: BTreeSet<u32>, rank: u32, world: u32) -> BTreeSet<u32> {
    if rank == 0 {
        near.extend(1..world);
    } else {
        near.insert(0);
    }
    near
}
