//! A node of a parameter-server run: servers run their shard and gate, workers train on their
//! share of every global batch, and server 0 collects every node's report into `summary.json`.

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::{NodeSummary, Summary};
use ringtmp_transport::Transport;
use ringtmp_wire::{Control, Message};

use crate::consistency::Consistency;
use crate::driver::{PsJob, WorkerEvent, run_worker};
use crate::plan::PsOptions;
use crate::server::run_server;
use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, NodeCx, PlanReport, Strategy, validate_shared};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::recorder::RunRecorder;
use ringtmp_contract::spec::RunSpec;

impl Strategy for PsJob {
    const NAME: &'static str = "ps";
    const FAMILY: ringtmp_contract::contract::Family =
        ringtmp_contract::contract::Family::ParameterServer;
    const SHORT_FORM: Option<(&'static str, &'static str)> = Some(("--consistency", "MODEL"));
    const CLIPS: bool = true;
    type Options = PsOptions;

    fn plan(
        config: TrainConfig,
        options: &PsOptions,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        crate::plan::plan(config, options, cluster, data, report)
    }

    /// The nodes that are not servers.
    fn workers(options: &PsOptions, nodes: u32) -> Result<usize> {
        Ok((nodes as usize)
            .saturating_sub(options.server_count(nodes)?)
            .max(1))
    }

    /// Worker 0 (the servers see no losses).
    fn progress_rank(&self) -> u32 {
        self.servers as u32
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn role(&self, rank: u32) -> String {
        if (rank as usize) < self.servers {
            format!(
                "parameter server {rank} of {}: a shard of the parameters and its optimizer state",
                self.servers
            )
        } else {
            format!(
                "worker {} of {}: computes gradients on its share of every batch",
                rank as usize - self.servers,
                self.workers
            )
        }
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, self.servers + self.workers)?;
        if self.servers == 0 || self.workers == 0 {
            return Err(Error::Config(format!(
                "invalid job: {} server(s) and {} worker(s)",
                self.servers, self.workers
            )));
        }
        if self
            .node_speeds
            .iter()
            .any(|s| !(s.is_finite() && *s > 0.0 && *s <= 1.0))
        {
            return Err(Error::Config(format!(
                "invalid job: node speeds {:?} (each in (0, 1])",
                self.node_speeds
            )));
        }
        Ok(())
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        star_neighbours(rank, world, self.servers as u32)
    }

    fn needs_data(&self, rank: u32) -> bool {
        rank as usize >= self.servers
    }

    fn expendable(&self, rank: u32) -> bool {
        rank as usize >= self.servers
            && (self.drop_dead_workers || self.consistency != Consistency::Bsp)
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        run(self, rank, cx)
    }
}

/// Parameter-server topology: every worker links to every server, and the servers link to each
/// other (server 0 collects the run's report; a clipped BSP iteration sends every server's share
/// of the norm to every other server). Servers are ranks `0..servers`.
pub fn star_neighbours(rank: u32, world_size: u32, servers: u32) -> BTreeSet<u32> {
    if rank < servers.max(1) {
        (0..world_size).filter(|&r| r != rank).collect()
    } else {
        (0..servers).collect()
    }
}

fn report_error(e: impl std::fmt::Display) -> Error {
    Error::Config(format!("a node's report is not valid: {e}"))
}

/// Runs this node's part of a parameter-server job; server 0 returns the run's summary.
fn run(job: &PsJob, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
    if (rank as usize) < job.servers {
        run_server_node(job, rank, cx.net)
    } else {
        run_worker_node(job, rank, cx)
    }
}

/// Server `rank`'s part: its shard served until the last worker is done, then its report;
/// server 0 gathers every node's and returns the run's summary.
fn run_server_node(job: &PsJob, rank: u32, net: &mut dyn Transport) -> Result<Option<Summary>> {
    // The node's clock (virtual in simulation), never `Instant`: the transport's contract.
    let time = net.clock();
    let started = time.now();
    // Server 0 reports the run: its log exists from the start.
    let recorder = (rank == 0)
        .then(|| {
            RunRecorder::open(
                &job.spec,
                PsJob::NAME,
                serde_json::json!({"servers": job.servers, "workers": job.workers,
                    "consistency": job.consistency.name()}),
            )
        })
        .transpose()?;
    let outcome = run_server(job, rank as usize, net)?;
    // Training ends when the last worker has finished; collecting the reports is not part
    // of it (their length, which depends on the values in them, must not move the time).
    let trained = (time.now() - started).as_secs_f64();
    let mut own = base_summary(rank, "server", outcome.params.len() as u64, net);
    own.staleness_histogram = outcome.staleness;
    own.update_staleness_histogram = outcome.update_staleness.histogram.clone();
    if job.consistency != Consistency::Bsp {
        tracing::info!(
            "server {rank}: mean update staleness {:.2} pushes",
            outcome.update_staleness.mean()
        );
    }
    own.dropped_workers = outcome.dropped.iter().map(|d| d.rank).collect();
    own.optimizer_bytes = own.param_bytes * optimizer_copies(job);
    if rank != 0 {
        report(net, &own)?;
        return Ok(None);
    }
    // Server 0: every other server's and every remaining worker's report.
    let expected = job.servers - 1 + job.workers - outcome.dropped.len();
    let mut per_node = vec![own];
    for doc in &outcome.reports {
        per_node.push(serde_json::from_str(doc).map_err(report_error)?);
    }
    while per_node.len() < expected + 1 {
        match net.recv(job.spec.recv_timeout())? {
            (_, Message::Control(Control::Report { nodes })) => {
                for doc in nodes {
                    per_node.push(serde_json::from_str(&doc).map_err(report_error)?);
                }
            }
            (from, _) => {
                return Err(Error::Config(format!(
                    "server 0: unexpected message from rank {from} while collecting reports"
                )));
            }
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
    let Some(mut recorder) = recorder else {
        unreachable!("server 0 opened the recorder")
    };
    let mut summary = summarize(job, &mut recorder, per_node, trained)?;
    summary.dropped_nodes = outcome.dropped.clone();
    let summary = recorder.finish(summary)?;
    Ok(Some(summary))
}

/// Worker `rank`'s part: its iterations against the servers, then its report to server 0;
/// worker 0 also reports the run's progress and evaluates its replica.
fn run_worker_node(job: &PsJob, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
    let time = cx.net.clock();
    let data = cx.data()?;
    let net = &mut *cx.net;
    let on_event = &mut *cx.on_event;
    let w = rank as usize - job.servers;
    let speed = job.node_speeds.get(rank as usize).copied().unwrap_or(1.0);
    // Worker 0 reports the run's progress (the servers see no losses): its units' losses as
    // step lines, and it evaluates its replica at the first pull at or past every
    // `eval_every`-th global iteration and every epoch end (under dynamic assignment its units
    // skip iterations), on a clock that excludes the evaluations themselves.
    let reports = w == 0;
    let eval_every = job.spec.eval_every;
    let (mut evaluations, mut eval_seconds) = (Vec::new(), 0.0f64);
    let mut errors = Vec::new();
    let mut steps = Vec::new();
    let first = job.first_step();
    let total = job.spec.total_steps;
    let record_every = total
        .saturating_sub(first)
        .div_ceil(ringtmp_metrics::MAX_REPORTED_STEPS)
        .max(1);
    let global_batch = (job.spec.batch_size * job.workers) as u64;
    let clock = time.now();
    let (mut last, mut last_step) = (first, first);
    if reports {
        on_event(&ringtmp_contract::Event::Started {
            total_steps: total,
            first_step: first,
            params: job.layers()?.iter().map(|l| l.param_count()).sum(),
            stage_params: Vec::new(),
        });
    }
    let mut worker_event = |event: WorkerEvent<'_>| -> Result<()> {
        if !reports {
            return Ok(());
        }
        let train_seconds = (time.now() - clock).as_secs_f64() - eval_seconds;
        match event {
            WorkerEvent::Pulled {
                iteration: t,
                stage,
            } => {
                let crossed = |every: u64| every > 0 && t / every > last / every;
                let due = crossed(job.spec.steps_per_epoch) || crossed(eval_every);
                last = last.max(t);
                if due {
                    let started = time.now();
                    let score =
                        ringtmp_contract::evaluation::evaluate(stage, &data.test, data.classes)?;
                    eval_seconds += (time.now() - started).as_secs_f64();
                    evaluations.push((t, score.accuracy, score.loss, train_seconds));
                    errors.extend(score.rmse.into_iter().chain(score.mae));
                    on_event(&ringtmp_contract::Event::Eval {
                        step: t,
                        epoch: t.saturating_sub(1) / job.spec.steps_per_epoch.max(1),
                        accuracy: score.accuracy,
                        loss: score.loss,
                        rmse: score.rmse,
                        mae: score.mae,
                    });
                }
            }
            WorkerEvent::Pushed {
                iteration,
                loss,
                lr,
            } => {
                let done = iteration + 1;
                // Under dynamic assignment a worker may take two units of one iteration: its
                // first counts.
                if done <= last_step {
                    return Ok(());
                }
                last_step = done;
                if (done - first.min(done)) % record_every == 0 || done == total {
                    steps.push((done, loss, lr, train_seconds));
                }
                let samples = done.saturating_sub(first) * global_batch;
                on_event(&ringtmp_contract::Event::Step {
                    step: done,
                    epoch: iteration / job.spec.steps_per_epoch.max(1),
                    loss,
                    samples_per_second: samples as f64 / train_seconds.max(1e-9),
                });
            }
        }
        Ok(())
    };
    let (outcome, mut stage) = run_worker(job, w, data, speed, net, &mut worker_event)?;
    // The final replica (the last pull's parameters) is an evaluation point too: a run that
    // reaches the target only at its end has reached it, at that time.
    let finished_at = (time.now() - clock).as_secs_f64() - eval_seconds;
    let mut own = base_summary(rank, "worker", stage.params().len() as u64, net);
    own.iterations = outcome.iterations;
    own.wait_seconds = outcome.wait_seconds;
    own.compute_seconds = outcome.compute_seconds;
    own.idle_seconds = outcome.wait_seconds;
    own.final_epoch_loss_sum = outcome.final_epoch_loss_sum;
    own.final_epoch_units = outcome.final_epoch_units;
    if w == 0 {
        let score = ringtmp_contract::evaluation::evaluate(&mut stage, &data.test, data.classes)?;
        own.test_accuracy = Some(score.accuracy);
        // The final replica holds every iteration of the run (under BSP exactly; otherwise up
        // to the pushes still in flight when the work ran out).
        let end = job.spec.total_steps;
        if evaluations.last().map(|e| e.0) != Some(end) {
            evaluations.push((end, score.accuracy, score.loss, finished_at));
            errors.extend(score.rmse.into_iter().chain(score.mae));
        }
        own.evaluations = evaluations;
        own.evaluation_errors = errors;
        own.steps = steps;
    }
    report(net, &own)?;
    Ok(None)
}

fn optimizer_copies(job: &PsJob) -> u64 {
    match job.spec.optimizer {
        ringtmp_model::OptimizerConfig::Sgd { .. } => 1,
        ringtmp_model::OptimizerConfig::Adam { .. }
        | ringtmp_model::OptimizerConfig::AdamW { .. } => 2,
    }
}

fn base_summary(rank: u32, role: &str, params: u64, net: &dyn Transport) -> NodeSummary {
    let links = net.stats();
    let os = ringtmp_contract::machine::ProcessReadings::of(net.clock().as_ref());
    NodeSummary {
        rank,
        role: role.into(),
        params,
        param_bytes: params * 4,
        peak_rss_bytes: os.peak_rss_bytes,
        bytes_sent: links.iter().map(|l| l.bytes_sent).sum(),
        bytes_received: links.iter().map(|l| l.bytes_received).sum(),
        messages_sent: links.iter().map(|l| l.messages_sent).sum(),
        cpu_seconds: os.cpu_seconds,
        steal_seconds: os.steal_seconds,
        throttled_seconds: os.throttled_seconds,
        links: links
            .iter()
            .map(|l| (l.peer, l.bytes_sent, l.bytes_received))
            .collect(),
        ..Default::default()
    }
}

fn report(net: &mut dyn Transport, own: &NodeSummary) -> Result<()> {
    let doc = serde_json::to_string(own).map_err(report_error)?;
    net.send(0, Message::Control(Control::Report { nodes: vec![doc] }))?;
    Ok(())
}

/// Server 0's summary of the run from every node's report, with worker 0's evaluations (in
/// global iterations) recorded in `metrics.jsonl` on the way.
fn summarize(
    job: &PsJob,
    recorder: &mut RunRecorder,
    mut per_node: Vec<NodeSummary>,
    wall: f64,
) -> Result<Summary> {
    let samples: u64 = per_node
        .iter()
        .filter(|n| n.role == "worker")
        .map(|n| n.iterations * job.spec.batch_size as u64)
        .sum();
    let total_bytes_sent: u64 = per_node.iter().map(|n| n.bytes_sent).sum();
    // Each evaluation with its errors (regression).
    type Evaluation = ((u64, f64, f64, f64), Option<(f64, f64)>);
    let mut evaluations: Vec<Evaluation> = per_node
        .iter()
        .flat_map(|n| {
            n.evaluations.iter().enumerate().map(|(k, e)| {
                let errors = n.evaluation_errors.get(2 * k..2 * k + 2);
                (*e, errors.map(|p| (p[0], p[1])))
            })
        })
        .collect();
    evaluations.sort_by_key(|e| e.0.0);
    // Worker 0's step records, each before the evaluations after it; not kept in the summary.
    let mut steps: Vec<(u64, f64, f32, f64)> = per_node
        .iter_mut()
        .flat_map(|n| std::mem::take(&mut n.steps))
        .collect();
    steps.sort_by_key(|s| s.0);
    let global_batch = (job.spec.batch_size * job.workers) as u64;
    let mut steps = steps.into_iter().peekable();
    for &((iteration, accuracy, loss, seconds), errors) in &evaluations {
        while let Some((done, loss, lr, seconds)) = steps.next_if(|s| s.0 <= iteration) {
            let samples = done.saturating_sub(job.first_step()) * global_batch;
            recorder.step(done, loss, lr, (seconds, samples))?;
        }
        let score = ringtmp_contract::evaluation::Score {
            accuracy,
            loss,
            rmse: errors.map(|e| e.0),
            mae: errors.map(|e| e.1),
        };
        // Replayed from worker 0's report after the run: too late to keep or stop on.
        let _ = recorder.eval(iteration, score, seconds, seconds)?;
    }
    for (done, loss, lr, seconds) in steps {
        let samples = done.saturating_sub(job.first_step()) * global_batch;
        recorder.step(done, loss, lr, (seconds, samples))?;
    }
    let model_params = per_node
        .iter()
        .filter(|n| n.role == "server")
        .map(|n| n.params)
        .sum();
    // The mean loss of the units of the final epoch, over every worker that computed some.
    let units: u64 = per_node.iter().map(|n| n.final_epoch_units).sum();
    let loss_sum: f64 = per_node.iter().map(|n| n.final_epoch_loss_sum).sum();
    Ok(Summary {
        consistency: Some(job.consistency.name()),
        model_params,
        steps: job.spec.total_steps,
        samples: recorder.run_figures(wall, samples).1,
        final_train_loss: if units == 0 {
            f64::NAN
        } else {
            loss_sum / units as f64
        },
        final_test_accuracy: per_node
            .iter()
            .find_map(|n| n.test_accuracy)
            .unwrap_or(recorder.tracker().last),
        // The whole run's (a restarted run's earlier attempts included); the bytes are this
        // attempt's nodes', per its samples.
        wall_seconds: recorder.carried().wall_seconds + wall,
        train_seconds: recorder.run_figures(wall, samples).0,
        samples_per_second: {
            let (seconds, samples) = recorder.run_figures(wall, samples);
            samples as f64 / seconds.max(1e-9)
        },
        total_bytes_sent,
        bytes_per_sample: total_bytes_sent as f64 / samples.max(1) as f64,
        per_node,
        ..recorder.summary(PsJob::NAME, (job.servers + job.workers) as u32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_star_links_workers_to_every_server_and_servers_to_each_other() {
        assert_eq!(star_neighbours(0, 5, 2), BTreeSet::from([1, 2, 3, 4]));
        assert_eq!(star_neighbours(1, 5, 2), BTreeSet::from([0, 2, 3, 4]));
        assert_eq!(star_neighbours(3, 5, 2), BTreeSet::from([0, 1]));
        // Three servers: server 1 reaches server 2 (the norm shares of a clipped iteration).
        assert_eq!(star_neighbours(1, 6, 3), BTreeSet::from([0, 2, 3, 4, 5]));
        assert_eq!(star_neighbours(2, 6, 3), BTreeSet::from([0, 1, 3, 4, 5]));
    }
}
