//! The distributed strategies run as the `ringtmp node` command runs them (close on success,
//! abort on failure), on any [`Backend`], with every node's result collected.

use std::path::Path;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;
use ringtmp_strategy::Job;
use ringtmp_strategy::allreduce::AllReduceJob;
use ringtmp_strategy::param_server::driver::{PsJob, ServerOutcome, WorkerOutcome};
use ringtmp_strategy::ring::net::Plain;
use ringtmp_strategy::ring::run::driver::{MasterOutcome, MasterSetup, RingJob};
use ringtmp_transport::Transport;

use crate::nodes::{Backend, Ran, ring, run_nodes, star};

/// What a node of a ring returned.
pub enum RingNode {
    /// The master's outcome (summary, stage 0, head).
    Master(Box<MasterOutcome>),
    /// Another stage's final parameters.
    Stage(Vec<f32>),
}

/// Ends a node's run as `ringtmp node` does: an orderly close after success, an abort (which
/// stops the others) after a failure.
fn end<T>(net: &mut dyn Transport, result: ringtmp_strategy::Result<T>) -> Result<T, String> {
    match result {
        Ok(v) => {
            net.close().map_err(|e| e.to_string())?;
            Ok(v)
        }
        Err(e) => {
            let text = e.to_string();
            net.abort(&text);
            Err(text)
        }
    }
}

/// Runs a ring job on `backend`, auditing what the master sends; evaluations every
/// `eval_every` steps.
pub fn ring_nodes(
    backend: &Backend,
    job: &RingJob,
    data: &Dataset,
    out: &Path,
    eval_every: u64,
) -> Ran<Result<RingNode, String>> {
    use ringtmp_strategy::ring::run::driver::{run_master, run_worker};
    let n = job.partition.len() as u32;
    let mut job = job.clone();
    job.spec.config.out = out.to_path_buf();
    job.spec.config.eval_every = eval_every;
    let job = &job;
    let setup = MasterSetup { data };
    run_nodes(backend, ring(n), Some(0), |rank, net| {
        if rank == 0 {
            let result = run_master(job, &setup, &mut Plain(net), &mut |_| {});
            end(net, result).map(|o| RingNode::Master(Box::new(o)))
        } else {
            let result = run_worker(job, &mut Plain(net));
            end(net, result).map(|s| RingNode::Stage(s.params().to_vec()))
        }
    })
}

/// Runs any job on `backend` as `ringtmp node` runs it, asking only the contract: each rank's
/// links (`neighbours`), whether it reads the data (`needs_data`), and its part (`run`); every
/// node returns its summary (rank 0 the run's). With [`crate::oracle::checkpoint_params`] on the
/// run's directory, a test reads the model any strategy left, whatever its partition.
pub fn job_nodes(
    backend: &Backend,
    job: &Job,
    data: &Dataset,
    world: u32,
) -> Ran<Result<Option<Summary>, String>> {
    let links = (0..world).map(|r| job.neighbours(r, world)).collect();
    run_nodes(backend, links, Some(0), |rank, net| {
        let mut on_event = |_: &ringtmp_strategy::Event| {};
        let mut cx = ringtmp_strategy::NodeCx {
            net: &mut *net,
            data: job.needs_data(rank).then_some(data),
            on_event: &mut on_event,
        };
        let result = job.run(rank, &mut cx);
        end(net, result)
    })
}

/// Runs a ring job through the contract ([`job_nodes`]) with the links the job asks for: stage
/// replicas (every node linked to every other, healing around dead nodes) and rings of rings
/// (its ring and its stage's copies); the master returns the run's summary, the others nothing.
pub fn healing_ring_nodes(
    backend: &Backend,
    job: &RingJob,
    data: &Dataset,
    out: &Path,
) -> Ran<Result<Option<Summary>, String>> {
    let n = (job.partition.len() * job.replicas.max(1)) as u32;
    let mut job = job.clone();
    job.spec.config.out = out.to_path_buf();
    job_nodes(backend, &Job::Ring(job), data, n)
}

/// Every stage's parameters in layer order, and the master's summary, of a ring run in which
/// every node succeeded.
///
/// # Panics
/// If a node failed.
pub fn ring_params(results: Vec<Result<RingNode, String>>) -> (Vec<f32>, Summary) {
    let mut nodes = results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("ring node {rank} failed: {e}")));
    let Some(RingNode::Master(master)) = nodes.next() else {
        panic!("rank 0 is the master")
    };
    let mut params = master.stage.params().to_vec();
    for node in nodes {
        let RingNode::Stage(p) = node else {
            panic!("only rank 0 is the master")
        };
        params.extend(p);
    }
    // The head, when the master holds it, is the model's last block.
    if let Some(head) = &master.head {
        params.extend_from_slice(head.params());
    }
    (params, master.summary)
}

/// What a node of a parameter-server run returned.
pub enum PsNode {
    /// A server's outcome (its shard, staleness, dropped workers).
    Server(Box<ServerOutcome>),
    /// A worker's outcome and the test accuracy of its final replica.
    Worker(WorkerOutcome, f64),
}

/// Runs a parameter-server job on `backend`; `speeds[w]` slows worker `w`.
pub fn ps_nodes(
    backend: &Backend,
    job: &PsJob,
    data: &Dataset,
    speeds: &[f64],
) -> Ran<Result<PsNode, String>> {
    ps_nodes_audited(backend, job, data, speeds, None)
}

/// [`ps_nodes`], recording every message rank `audit` sends.
pub fn ps_nodes_audited(
    backend: &Backend,
    job: &PsJob,
    data: &Dataset,
    speeds: &[f64],
    audit: Option<u32>,
) -> Ran<Result<PsNode, String>> {
    use ringtmp_strategy::param_server::driver::run_worker;
    use ringtmp_strategy::param_server::server::run_server;
    let n = (job.servers + job.workers) as u32;
    run_nodes(backend, star(n, job.servers as u32), audit, |r, net| {
        if (r as usize) < job.servers {
            let result = run_server(job, r as usize, net);
            end(net, result).map(|o| PsNode::Server(Box::new(o)))
        } else {
            let w = r as usize - job.servers;
            let speed = speeds.get(w).copied().unwrap_or(1.0);
            let result = run_worker(job, w, data, speed, net, &mut |_| Ok(())).and_then(
                |(outcome, mut stage)| {
                    let accuracy = ringtmp_strategy::evaluation::evaluate(
                        &mut stage,
                        &data.test,
                        data.classes,
                    )?
                    .accuracy;
                    Ok((outcome, accuracy))
                },
            );
            end(net, result).map(|(o, a)| PsNode::Worker(o, a))
        }
    })
}

/// The servers' shards concatenated (the model's parameters), of a run in which every server
/// succeeded.
///
/// # Panics
/// If a server failed.
pub fn ps_params(results: &[Result<PsNode, String>]) -> Vec<f32> {
    let mut params = Vec::new();
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok(PsNode::Server(s)) => params.extend_from_slice(&s.params),
            Ok(PsNode::Worker(..)) => {}
            Err(e) => panic!("node {rank} failed: {e}"),
        }
    }
    params
}

/// What an all-reduce worker returned: its replica's parameters, and on rank 0 the summary.
pub type Replica = Result<(Vec<f32>, Option<Summary>), String>;

/// Runs an all-reduce job on `backend`; every worker returns its replica's parameters and rank 0
/// the run's summary.
pub fn allreduce_nodes(
    backend: &Backend,
    job: &AllReduceJob,
    data: &Dataset,
    out: &Path,
) -> Ran<Replica> {
    let mut job = job.clone();
    job.spec.config.out = out.to_path_buf();
    let job = &job;
    let n = job.workers as u32;
    let links = (0..n)
        .map(|r| ringtmp_strategy::Strategy::neighbours(job, r, n))
        .collect();
    run_nodes(backend, links, None, |rank, net| {
        let result =
            ringtmp_strategy::allreduce::driver::run_worker(job, rank, data, net, &mut |_| {});
        end(net, result).map(|o| (o.stage.params().to_vec(), o.summary))
    })
}

/// Runs a DiLoCo job on `backend`; every worker returns its replica and rank 0 the run's
/// summary.
pub fn diloco_nodes(
    backend: &Backend,
    job: &ringtmp_strategy::diloco::DilocoJob,
    data: &Dataset,
    out: &Path,
) -> Ran<Replica> {
    let mut job = job.clone();
    job.spec.config.out = out.to_path_buf();
    let job = &job;
    let n = job.workers as u32;
    let links = (0..n)
        .map(|r| ringtmp_strategy::Strategy::neighbours(job, r, n))
        .collect();
    run_nodes(backend, links, None, |rank, net| {
        let result =
            ringtmp_strategy::diloco::driver::run_worker(job, rank, data, net, &mut |_| {});
        end(net, result).map(|o| (o.stage.params().to_vec(), o.summary))
    })
}

/// Runs a D-PSGD job on `backend`, every worker from `initial(rank)` when given; every worker
/// returns its own model and rank 0 the run's summary.
pub fn dpsgd_nodes(
    backend: &Backend,
    job: &ringtmp_strategy::gossip::DpsgdJob,
    data: &Dataset,
    out: &Path,
    initial: Option<&(dyn Fn(u32) -> Vec<f32> + Sync)>,
) -> Ran<Replica> {
    use ringtmp_strategy::Strategy;
    let mut job = job.clone();
    job.spec.config.out = out.to_path_buf();
    let job = &job;
    let n = job.workers as u32;
    let links: Vec<_> = (0..n).map(|r| job.neighbours(r, n)).collect();
    run_nodes(backend, links, None, |rank, net| {
        let start = initial.map(|f| f(rank));
        let result = ringtmp_strategy::gossip::dpsgd::run_worker_from(
            job,
            rank,
            data,
            net,
            &mut |_| {},
            start.as_deref(),
        );
        end(net, result).map(|o| (o.stage.params().to_vec(), o.summary))
    })
}

/// What an AD-PSGD worker returns: its model, the averagings it took part in, and rank 0's
/// summary.
pub type GossipReplica = Result<(Vec<f32>, u64, Option<Summary>), String>;

/// Runs an AD-PSGD job on `backend`, every worker from `initial(rank)` when given.
pub fn adpsgd_nodes(
    backend: &Backend,
    job: &ringtmp_strategy::gossip::AdpsgdJob,
    data: &Dataset,
    out: &Path,
    initial: Option<&(dyn Fn(u32) -> Vec<f32> + Sync)>,
) -> Ran<GossipReplica> {
    use ringtmp_strategy::Strategy;
    let mut job = job.clone();
    job.spec.config.out = out.to_path_buf();
    let job = &job;
    let n = job.workers as u32;
    let links: Vec<_> = (0..n).map(|r| job.neighbours(r, n)).collect();
    run_nodes(backend, links, None, |rank, net| {
        let start = initial.map(|f| f(rank));
        let result = ringtmp_strategy::gossip::adpsgd::run_worker(
            job,
            rank,
            data,
            net,
            &mut |_| {},
            start.as_deref(),
        );
        end(net, result).map(|o| (o.model, o.averagings, o.summary))
    })
}
