//! One worker of D-PSGD (Lian et al., NeurIPS 2017): synchronous decentralised SGD. Every
//! iteration a worker computes the gradient of its share of the global batch at its own model
//! x_i, sends x_i to its neighbours, replaces it by the uniform average of itself and what they
//! sent (the mixing matrix of [`ringtmp_collective::mixing`]), and applies its gradient:
//! x_i ← Σ_j W_ij x_j − γ ∇F_i(x_i).
//!
//! At every evaluation (and checkpoint) every worker sends its model to rank 0, which forms the
//! consensus model x̄ the papers evaluate, records the consensus distance (mean ‖x_i − x̄‖ / ‖x̄‖)
//! and checkpoints x̄ with every worker's own model. Invariants: a model is averaged with its
//! neighbours' in rank order (reproducible); messages of one link arrive in order, so a worker
//! reads each neighbour's model of this iteration before anything that neighbour sends later.
//!
//! A dead worker ends the run, named, unless `--drop-dead-workers`: then its neighbours drop it
//! and go on. The degrees around the gap then differ, and uniform weights would no longer make
//! W symmetric, so a worker whose neighbours' degrees (sent with every model) differ from its own
//! mixes with Metropolis–Hastings weights w_ij = 1 / (1 + max(d_i, d_j)), w_ii = 1 − Σ_j w_ij:
//! symmetric and doubly stochastic on any graph, and the uniform weights when degrees are equal.

use ringtmp_data::Dataset;
use std::collections::BTreeSet;

use ringtmp_metrics::{DroppedNode, Summary};
use ringtmp_model::Stage;
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Dtype, Message, TensorTag};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::replicas::WorkerOutcome;
use crate::worker_loop::{self, Ending, Log, Opening, RecordedModel, Stepped, SyncRule, Worker};
use ringtmp_collective::mixing::{self, Topology};
use ringtmp_collective::whole_model::{holds, model_message};
use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, NodeCx, PlanReport, Strategy, validate_shared};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::options_merge;
use ringtmp_contract::spec::RunSpec;

/// `--strategy` name of D-PSGD.
pub const NAME: &str = "dpsgd";

/// `ringtmp train --strategy dpsgd` options (flags, and keys of a `--config` file).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(rename_all = "kebab-case")]
pub struct DpsgdOptions {
    /// D-PSGD: communication graph, ring or exp (the ring plus links 2^i hops away)
    /// [default: ring].
    #[cfg_attr(feature = "cli", arg(long, value_enum))]
    pub topology: Option<Topology>,
    /// `--drop-dead-workers`, which the parameter server's options own (one flag for both);
    /// the CLI copies it here.
    #[cfg_attr(feature = "cli", arg(skip))]
    #[serde(skip)]
    pub drop_dead_workers: Option<bool>,
}

options_merge!(DpsgdOptions, topology, drop_dead_workers);

/// D-PSGD's job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DpsgdJob {
    /// What every job shares; `batch_size` is one worker's share of each global batch.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Workers (every node is one).
    pub workers: usize,
    /// Who averages with whom.
    pub topology: Topology,
    /// Emulated relative speed per rank.
    pub node_speeds: Vec<f64>,
    /// A dead worker is dropped by its neighbours instead of ending the run.
    #[serde(default)]
    pub drop_dead_workers: bool,
}

impl Strategy for DpsgdJob {
    const NAME: &'static str = NAME;
    const FAMILY: ringtmp_contract::contract::Family = ringtmp_contract::contract::Family::Replicas;
    const SHORT_FORM: Option<(&'static str, &'static str)> = Some(("--topology", "TOPOLOGY"));
    const CLIPS: bool = true;
    type Options = DpsgdOptions;

    fn plan(
        config: TrainConfig,
        options: &DpsgdOptions,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        // Averaging the models averages their updates: the consensus moves as all-reduce's
        // model does, so the default rate scales with the workers as there.
        let (spec, workers) = crate::replicas::plan_spec(NAME, config, cluster, data, report)?;
        let global = spec.batch_size * workers;
        let topology = options.topology.unwrap_or_default();
        report.note(format!(
            "d-psgd: {workers} workers of batch {} (global batch {global}), {topology:?} graph \
             (second eigenvalue of the mixing matrix {:.3}), learning rate {}",
            spec.batch_size,
            mixing::second_eigenvalue(topology, workers as u32),
            spec.lr
        ));
        Ok(Self {
            spec,
            workers,
            topology,
            node_speeds: cluster.node_speeds.clone(),
            drop_dead_workers: options.drop_dead_workers.unwrap_or(false),
        })
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, self.workers)?;
        if self.workers < 2 {
            return Err(Error::Config(format!(
                "invalid job: {} workers",
                self.workers
            )));
        }
        crate::replicas::check_speeds(&self.node_speeds, self.workers)
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        // The gossip graph, and rank 0 (which gathers the models for the consensus) with all.
        let near = mixing::neighbours(self.topology, rank, world);
        crate::replicas::with_rank_zero(near, rank, world)
    }

    fn expendable(&self, rank: u32) -> bool {
        self.drop_dead_workers && rank != 0
    }

    fn needs_data(&self, _: u32) -> bool {
        true
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        let data = cx.data()?;
        run_worker(self, rank, data, cx.net, cx.on_event).map(|o| o.summary)
    }
}

/// `micro_batch` of a model sent to rank 0 for the consensus.
const TO_RANK0: u64 = u64::MAX;

/// What a worker knows of the others: its live gossip neighbours and who has left.
struct Peers {
    near: BTreeSet<u32>,
    dropped: Vec<DroppedNode>,
    gone: BTreeSet<u32>,
    /// What the run loop has yet to report as [`ringtmp_contract::Event::Notice`]s.
    notices: Vec<String>,
}

impl Peers {
    /// A transport failure at `step`: with `--drop-dead-workers` a dead worker is dropped (its
    /// neighbours go on without it); otherwise, and for rank 0 or any other failure, the run
    /// ends naming the peer.
    fn lost(&mut self, job: &DpsgdJob, rank: u32, step: u64, e: TransportError) -> Result<()> {
        match e.failed_peer() {
            Some(dead) if job.drop_dead_workers && dead != 0 && dead != rank => {
                self.near.remove(&dead);
                if self.gone.insert(dead) {
                    self.notices.push(format!(
                        "d-psgd: rank {rank}: rank {dead} left the run at step {step} ({e}); \
                         going on without it (--drop-dead-workers)"
                    ));
                    self.dropped.push(DroppedNode {
                        rank: dead,
                        step,
                        reason: e.to_string(),
                    });
                }
                Ok(())
            }
            _ => Err(e.into()),
        }
    }
}

/// Mixes `own` with the neighbours' models `(degree, values)`: uniform weights when every
/// degree equals ours, Metropolis–Hastings weights otherwise (see the module's header).
fn mix(own: &mut [f32], degree: usize, received: &[(usize, Vec<f32>)]) {
    if received.iter().all(|(d, _)| *d == degree) {
        let weight = 1.0 / (received.len() + 1) as f32;
        for (_, x) in received {
            own.iter_mut().zip(x).for_each(|(m, v)| *m += v);
        }
        own.iter_mut().for_each(|m| *m *= weight);
        return;
    }
    let start = own.to_vec();
    for (d, x) in received {
        let w = 1.0 / (1 + degree.max(*d)) as f32;
        own.iter_mut()
            .zip(x.iter().zip(&start))
            .for_each(|(m, (v, s))| *m += w * (v - s));
    }
}

/// Rank 0 gathers every live worker's model (its own first) for step `done`; the others send
/// theirs. Returns the models on rank 0.
fn gather_models(
    net: &mut dyn Transport,
    job: &DpsgdJob,
    rank: u32,
    peers: &mut Peers,
    params: &[f32],
    done: u64,
) -> Result<Option<super::consensus::Models>> {
    if rank != 0 {
        net.send(0, model_message(net, params, done, TO_RANK0, Dtype::F32))?;
        return Ok(None);
    }
    let mut models = vec![(0, params.to_vec())];
    let mut values = Vec::new();
    for r in 1..job.workers as u32 {
        while !peers.gone.contains(&r) {
            match net.recv_from(r, job.spec.recv_timeout()) {
                Ok(Message::Tensor(h, bytes))
                    if h.tag == TensorTag::Params
                        && h.micro_batch == TO_RANK0
                        && h.step == done
                        && holds(&h, params.len()) =>
                {
                    tensor_values(&bytes, h.dtype, &mut values);
                    net.buffers().give(bytes);
                    models.push((r, values.clone()));
                    break;
                }
                Ok(_) => {
                    return Err(Error::protocol(
                        "d-psgd",
                        net,
                        r,
                        "message instead of its model",
                    ));
                }
                Err(e) => peers.lost(job, rank, done, e)?,
            }
        }
    }
    Ok(Some(models))
}

/// Runs worker `rank` of `job` on `data`; rank 0 evaluates the consensus model, checkpoints it
/// and writes the run's outputs.
pub fn run_worker(
    job: &DpsgdJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<WorkerOutcome> {
    run_worker_from(job, rank, data, net, on_event, None)
}

/// [`run_worker`] from the given initial model instead of the seed's (tests of the gossip
/// itself start the workers apart).
pub fn run_worker_from(
    job: &DpsgdJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
    initial: Option<&[f32]>,
) -> Result<WorkerOutcome> {
    let opening = Opening {
        initial,
        ..Opening::of(&job.spec, NAME, rank, job.workers, &job.node_speeds, data)
    };
    let make = |_: &Worker<'_>| {
        Ok(Mixing {
            job,
            peers: Peers {
                near: mixing::neighbours(job.topology, rank, job.workers as u32),
                dropped: Vec::new(),
                gone: BTreeSet::new(),
                notices: Vec::new(),
            },
            received: Vec::new(),
            last_distance: None,
        })
    };
    worker_loop::run(&opening, make, net, on_event)
}

/// D-PSGD's synchronisation: every step, this worker's model mixed with its neighbours'.
struct Mixing<'j> {
    job: &'j DpsgdJob,
    peers: Peers,
    /// The neighbours' models of this step (degree, values), reused from step to step.
    received: Vec<(usize, Vec<f32>)>,
    /// The consensus distance at the last gathering.
    last_distance: Option<f64>,
}

impl Mixing<'_> {
    fn tell(&mut self, on_event: &mut dyn FnMut(&ringtmp_contract::Event)) {
        for text in self.peers.notices.drain(..) {
            on_event(&ringtmp_contract::Event::Notice { text });
        }
    }
}

impl SyncRule for Mixing<'_> {
    fn start_fields(&self, _: &Worker<'_>) -> serde_json::Value {
        let (n, topology) = (self.job.workers as u32, self.job.topology);
        json!({"workers": n, "topology": topology,
               "second_eigenvalue": mixing::second_eigenvalue(topology, n)})
    }

    fn step(
        &mut self,
        worker: &mut Worker<'_>,
        step: u64,
        net: &mut dyn Transport,
        log: &mut Log<'_>,
    ) -> Result<Stepped> {
        self.tell(log.on_event);
        let spec = worker.spec;
        let span = worker.start_compute();
        let loss = worker.forward(worker.rank, self.job.workers, step)?;
        worker.stage.backward(0, &worker.share.dlogits)?;
        if let Some(max_norm) = spec.clip_grad_norm {
            // Each worker's own gradient, the one it applies: decentralised SGD has no other.
            ringtmp_contract::clipping::clip_whole(&mut worker.stage, max_norm);
        }
        worker.computed(span);
        // Gossip: our model (and degree) to every neighbour, theirs mixed with ours in rank
        // order.
        let waited = worker.clock.now();
        let degree = self.peers.near.len();
        let heard = exchange(
            net,
            self.job,
            worker.rank,
            step,
            &mut self.peers,
            worker.stage.params(),
            &mut self.received,
        )?;
        worker.waited_since(waited);
        if !ringtmp_meter::phantom() {
            // (A sizes-only run's models carry no values: mixing would only write memory.)
            mix(worker.stage.params_mut(), degree, &self.received[..heard]);
        }
        let lr = spec.lr_at(step);
        let span = worker.start_compute();
        worker.stage.step(&mut worker.optimizer, lr);
        worker.computed(span);
        worker.iterations += 1;
        Ok(Stepped::Trained {
            loss: Some(loss),
            lr,
            next: step + 1,
        })
    }

    fn with_model(
        &mut self,
        worker: &mut Worker<'_>,
        done: u64,
        net: &mut dyn Transport,
        record: &mut dyn FnMut(RecordedModel<'_>) -> Result<()>,
    ) -> Result<()> {
        // Every worker sends its model to rank 0, which forms the consensus.
        let gathered = gather_models(
            net,
            self.job,
            worker.rank,
            &mut self.peers,
            worker.stage.params(),
            done,
        )?;
        let Some(models) = gathered else {
            return Ok(());
        };
        let (mean, distance) = super::consensus::consensus(&models);
        self.last_distance = Some(distance);
        let spec = worker.spec;
        let mut model = Stage::new(
            &worker.layers,
            0..worker.layers.len(),
            spec.seed,
            spec.threads,
        );
        model.params_mut().copy_from_slice(&mean);
        // The consensus model, with rank 0's optimizer state, and every worker's own.
        let replicas: Vec<(u32, &[f32])> = models.iter().map(|(r, m)| (*r, &m[..])).collect();
        record(RecordedModel {
            stage: &mut model,
            optimizer: &worker.optimizer,
            replicas: &replicas,
            after_eval: Some(json!({"event": "consensus", "step": done, "distance": distance})),
        })
    }

    fn finish(
        &mut self,
        worker: &mut Worker<'_>,
        on_event: &mut dyn FnMut(&ringtmp_contract::Event),
    ) -> Result<Ending> {
        self.tell(on_event);
        // Each worker's own model's accuracy, and the reports to rank 0.
        let data = worker.data;
        let own =
            ringtmp_contract::evaluation::evaluate(&mut worker.stage, &data.test, data.classes)?;
        let n = self.job.workers as u32;
        Ok(Ending {
            members: (0..n).filter(|r| !self.peers.gone.contains(r)).collect(),
            dropped: std::mem::take(&mut self.peers.dropped),
            own_accuracy: Some(own.accuracy),
            consensus_distance: self.last_distance,
            ..Ending::default()
        })
    }
}

/// One gossip round of step `step`: this worker's model (and degree) to every live neighbour,
/// and theirs received into `received` (reused from step to step), in neighbour order; a
/// neighbour that died meanwhile is dropped (and not waited for). Returns how many arrived.
fn exchange(
    net: &mut dyn Transport,
    job: &DpsgdJob,
    rank: u32,
    step: u64,
    peers: &mut Peers,
    params: &[f32],
    received: &mut Vec<(usize, Vec<f32>)>,
) -> Result<usize> {
    let spec = &job.spec;
    let degree = peers.near.len();
    for p in peers.near.clone() {
        let message = model_message(net, params, step, degree as u64, spec.wire_dtype);
        if let Err(e) = net.send(p, message) {
            peers.lost(job, rank, step, e)?;
        }
    }
    let mut heard = 0;
    for p in peers.near.clone() {
        // A failure of another peer meanwhile does not excuse this one.
        while peers.near.contains(&p) {
            match net.recv_from(p, spec.recv_timeout()) {
                Ok(Message::Tensor(h, bytes))
                    if h.tag == TensorTag::Params && h.step == step && holds(&h, params.len()) =>
                {
                    if received.len() == heard {
                        received.push((0, Vec::new()));
                    }
                    let slot = &mut received[heard];
                    slot.0 = h.micro_batch as usize;
                    tensor_values(&bytes, h.dtype, &mut slot.1);
                    net.buffers().give(bytes);
                    heard += 1;
                    break;
                }
                Ok(_) => {
                    return Err(Error::protocol(
                        "d-psgd",
                        net,
                        p,
                        "message instead of its model",
                    ));
                }
                Err(e) => peers.lost(job, rank, step, e)?,
            }
        }
    }
    Ok(heard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metropolis_weights_keep_the_sum_when_a_worker_has_left() {
        // A ring of 5 without rank 2: the path 3 – 4 – 0 – 1, degrees 1, 2, 2, 1.
        let near: [&[u32]; 5] = [&[1, 4], &[0], &[], &[4], &[0, 3]];
        let mut x: Vec<Vec<f32>> = (0..5).map(|r| vec![r as f32 * 1.5 - 2.0, 1.0]).collect();
        x[2] = vec![0.0, 0.0];
        let sum = |x: &[Vec<f32>]| -> f32 { x.iter().map(|v| v[0]).sum() };
        let before = sum(&x);
        for _ in 0..50 {
            let old = x.clone();
            for r in [0usize, 1, 3, 4] {
                let received: Vec<(usize, Vec<f32>)> = near[r]
                    .iter()
                    .map(|&p| (near[p as usize].len(), old[p as usize].clone()))
                    .collect();
                mix(&mut x[r], near[r].len(), &received);
            }
            assert!((sum(&x) - before).abs() < 1e-4, "{} vs {before}", sum(&x));
        }
        // The survivors agree on the mean of their starting models.
        let mean = before / 4.0;
        for r in [0usize, 1, 3, 4] {
            assert!((x[r][0] - mean).abs() < 1e-3, "{:?}", x[r]);
            assert!((x[r][1] - 1.0).abs() < 1e-6);
        }
        // Equal degrees: the uniform weights, exactly.
        let mut own = vec![3.0f32];
        mix(&mut own, 2, &[(2, vec![1.0]), (2, vec![2.0])]);
        assert_eq!(own, [2.0]);
    }
}
