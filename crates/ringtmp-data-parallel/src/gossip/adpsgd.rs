//! AD-PSGD (Lian et al., ICML 2018): asynchronous decentralised SGD, `--strategy adpsgd`.
//!
//! Workers run at their own pace. The graph ([`ringtmp_collective::mixing::bipartite_neighbours`]) is
//! bipartite: even ranks are *active*, odd ranks *passive*. Each iteration an active worker
//! picks a random live passive neighbour, sends it its model x_a and, while the model travels,
//! computes its gradient on x_a; the passive worker answers with its model x_p and replaces it by
//! (x_a + x_p) / 2; on the answer the active worker does the same, so the pair ends with one
//! average (atomic: the active worker's model does not change between request and answer,
//! the passive's is averaged in one place). Then the active worker applies its gradient. A
//! passive worker computes and applies gradients too; it answers requests while it computes
//! (on a thread of its own: a slow passive worker does not hold back the active ones) and
//! applies its gradient, computed on the model it read, to its model as averaged meanwhile.
//!
//! Why it cannot deadlock: only active workers wait, only for passive ones, and a passive worker
//! never waits for anyone until the end; at the end a passive worker waits for its active
//! neighbours' `Finished`, serving their requests meanwhile (the seeds' argument).
//!
//! Rank 0 (active) also coordinates ([`super::coordinator`]): workers report every iteration,
//! it counts global steps (N iterations of b samples), records them, gathers the workers' models
//! to evaluate and checkpoint their average (`Snapshot`; workers answer between iterations, so
//! training does not stop), and tells everyone to stop when the run's samples are done. A dead
//! worker is skipped by its neighbours and no longer awaited by rank 0 (logged, and listed in
//! summary.json); rank 0's death ends the run (it holds the recorder).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::{NodeSummary, Summary};
use ringtmp_model::{Optimizer, Stage};
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Control, Dtype, Message, TensorTag};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::coordinator::{Action, Coordinator, gathering_due};
use super::pairing::{PairAction, Pairing};
use crate::replicas::{ShareBuffers, WorkerClock};
use ringtmp_collective::mixing;
use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{Cluster, NodeCx, PlanReport, Strategy, validate_shared};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;
use ringtmp_contract::spec::RunSpec;

/// `--strategy` name of AD-PSGD.
pub const NAME: &str = "adpsgd";

/// `micro_batch` of a model sent for averaging (request and answer).
const AVERAGE: u64 = 0;
/// `micro_batch` of a model sent to rank 0 (a gathering round or the final model).
const SNAPSHOT: u64 = 1;
/// `step` of the final model each worker sends rank 0.
const FINAL: u64 = u64::MAX;
/// How long a passive worker's network thread waits for a message before it checks on its
/// compute (wall clock only; a request is answered at once either way).
const POLL: Duration = Duration::from_millis(1);

/// AD-PSGD's job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdpsgdJob {
    /// What every job shares; `batch_size` is one worker's mini-batch.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Workers (every node is one; an even number, so the graph is bipartite).
    pub workers: usize,
    /// Emulated relative speed per rank.
    pub node_speeds: Vec<f64>,
}

impl Strategy for AdpsgdJob {
    const NAME: &'static str = NAME;
    const FAMILY: ringtmp_contract::contract::Family = ringtmp_contract::contract::Family::Replicas;
    const CLIPS: bool = true;
    type Options = ringtmp_contract::contract::NoOptions;

    fn plan(
        config: TrainConfig,
        _: &Self::Options,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        let (spec, workers) = crate::replicas::plan_spec(NAME, config, cluster, data, report)?;
        check_graph(workers)?;
        let near = mixing::bipartite_neighbours(0, workers as u32);
        report.note(format!(
            "ad-psgd: {workers} workers of batch {} ({} active, {} passive; each active worker \
             averages with one of {} passive neighbours per iteration), learning rate {}",
            spec.batch_size,
            workers.div_ceil(2),
            workers / 2,
            near.len(),
            spec.lr
        ));
        Ok(Self {
            spec,
            workers,
            node_speeds: cluster.node_speeds.clone(),
        })
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(&self.spec, world, self.workers)?;
        check_graph(self.workers)?;
        crate::replicas::check_speeds(&self.node_speeds, self.workers)
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        // The gossip graph, and rank 0 (the coordinator) with everyone.
        crate::replicas::with_rank_zero(mixing::bipartite_neighbours(rank, world), rank, world)
    }

    fn needs_data(&self, _: u32) -> bool {
        true
    }

    fn expendable(&self, rank: u32) -> bool {
        rank != 0
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        let data = cx.data()?;
        run_worker(self, rank, data, cx.net, cx.on_event, None).map(|o| o.summary)
    }
}

/// Refuses a worker count whose graph is not bipartite and connected.
fn check_graph(workers: usize) -> Result<()> {
    let n = workers as u32;
    if workers < 2 || mixing::two_colouring(n, |r| mixing::bipartite_neighbours(r, n)).is_none() {
        return Err(Error::Config(format!(
            "--strategy {NAME} needs an even number of nodes, at least 2: its graph (the ring and \
             the links 2^i + 1 hops away) must split into active and passive workers with every \
             link between the two (bipartite), which {workers} workers do not"
        )));
    }
    Ok(())
}

/// AD-PSGD's own wire messages (as [`StrategyMessage`]s).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdpsgdMessage {
    /// Rank 0 to a worker: iterations it may complete (rank 0 bounds how far anyone runs ahead
    /// of the run's steps).
    Allow {
        /// Its new grant.
        iterations: u64,
    },
    /// An active worker to its passive neighbours: it has finished its iterations.
    Finished {
        /// Iterations it completed.
        iterations: u64,
    },
    /// A worker to rank 0, every iteration: its count and the loss of its last one.
    Progress {
        /// Iterations it has completed.
        iterations: u64,
        /// Its last iteration's loss, as `f64::to_bits`.
        loss_bits: u64,
    },
    /// Rank 0 to a worker: send your model for gathering round `round`.
    Snapshot {
        /// The round.
        round: u64,
    },
    /// Rank 0 to every worker: the run's steps are done.
    Stop {
        /// The step the run stopped at.
        step: u64,
    },
}

impl StrategyMessage for AdpsgdMessage {
    const STRATEGY: &'static str = NAME;

    fn kind(&self) -> &'static str {
        match self {
            Self::Allow { .. } => "Allow",
            Self::Finished { .. } => "Finished",
            Self::Progress { .. } => "Progress",
            Self::Snapshot { .. } => "Snapshot",
            Self::Stop { .. } => "Stop",
        }
    }
}

/// What a worker returns: its own model, and on rank 0 the run's summary.
pub struct WorkerOutcome {
    /// This worker's final model.
    pub model: Vec<f32>,
    /// Averagings this worker took part in.
    pub averagings: u64,
    /// Rank 0's summary of the run.
    pub summary: Option<Summary>,
}

/// A worker's state that messages act on (its compute state is kept apart, so a passive
/// worker's compute thread and its network loop borrow different things).
struct Worker<'a> {
    job: &'a AdpsgdJob,
    rank: u32,
    /// Who to average with, when, and who is gone (the protocol's rules).
    pairing: Pairing,
    /// This worker's model x_i.
    model: Vec<f32>,
    /// What the run loop has yet to report as [`ringtmp_contract::Event::Notice`]s.
    notices: Vec<String>,
    /// Averagings this worker took part in.
    averagings: u64,
    /// Rank 0: the run's bookkeeping.
    coordinator: Option<Coordinator>,
    /// Rank 0: workers' final models and reports.
    finals: Vec<(u32, Vec<f32>)>,
    reports: Vec<NodeSummary>,
    received: Vec<f32>,
}

impl Worker<'_> {
    /// Acts on one message.
    fn handle(&mut self, net: &mut dyn Transport, from: u32, message: Message) -> Result<()> {
        if self.pairing.is_gone(from) {
            // Sent before it died, read after its death was noticed (a link's closure can be
            // reported while waiting on another link, ahead of what is still queued on its own):
            // old news, like everything else of the dead.
            if let Message::Tensor(_, bytes) = message {
                net.buffers().give(bytes);
            }
            return Ok(());
        }
        let own = match &message {
            Message::Control(control) => AdpsgdMessage::from_control(control, net, from)?,
            Message::Tensor(..) => None,
        };
        if let Some(own) = own {
            return self.handle_own(net, from, own);
        }
        match message {
            Message::Tensor(h, bytes)
                if h.tag == TensorTag::Params
                    && ringtmp_collective::whole_model::holds(&h, self.model.len()) =>
            {
                tensor_values(&bytes, h.dtype, &mut self.received);
                net.buffers().give(bytes);
                match h.micro_batch {
                    AVERAGE => {
                        let actions = self.pairing.handle_model(from, h.step);
                        self.act(net, from, h.step, actions)?;
                    }
                    SNAPSHOT if self.coordinator.is_some() => {
                        let model = std::mem::take(&mut self.received);
                        if h.step == FINAL {
                            self.finals.push((from, model));
                        } else if !self.coordinator_mut().snapshot(from, h.step, model) {
                            return Err(Error::protocol(
                                "ad-psgd",
                                net,
                                from,
                                "model for no gathering round",
                            ));
                        }
                    }
                    _ => return Err(Error::protocol("ad-psgd", net, from, "model")),
                }
            }
            Message::Control(Control::Report { nodes }) if self.coordinator.is_some() => {
                for doc in nodes {
                    self.reports.push(serde_json::from_str(&doc).map_err(|e| {
                        Error::Config(format!("rank {from}'s report is not valid: {e}"))
                    })?);
                }
            }
            _ => return Err(Error::protocol("ad-psgd", net, from, "message")),
        }
        Ok(())
    }

    /// Acts on one of AD-PSGD's own messages.
    fn handle_own(
        &mut self,
        net: &mut dyn Transport,
        from: u32,
        message: AdpsgdMessage,
    ) -> Result<()> {
        let actions = match message {
            AdpsgdMessage::Snapshot { round } if from == 0 => {
                net.send(
                    0,
                    ringtmp_collective::whole_model::model_message(
                        net,
                        &self.model,
                        round,
                        SNAPSHOT,
                        Dtype::F32,
                    ),
                )?;
                return Ok(());
            }
            AdpsgdMessage::Stop { .. } => self.pairing.handle_stop(from),
            AdpsgdMessage::Allow { iterations } => self.pairing.handle_allow(from, iterations),
            AdpsgdMessage::Finished { .. } => self.pairing.handle_finished(from),
            AdpsgdMessage::Progress {
                iterations,
                loss_bits,
            } if self.coordinator.is_some() => {
                self.coordinator_mut()
                    .progress(from, iterations, f64::from_bits(loss_bits));
                return Ok(());
            }
            _ => return Err(Error::protocol("ad-psgd", net, from, "message")),
        };
        self.act(net, from, 0, actions)
    }

    /// Does what the pairing decided on a message from `from` (a model's `iteration`) or on
    /// this worker's own iteration `iteration`, with the model in `received` where one arrived.
    fn act(
        &mut self,
        net: &mut dyn Transport,
        from: u32,
        iteration: u64,
        actions: Vec<PairAction>,
    ) -> Result<()> {
        for action in actions {
            match action {
                PairAction::Request { to, iteration } => {
                    let request = ringtmp_collective::whole_model::model_message(
                        net,
                        &self.model,
                        iteration,
                        AVERAGE,
                        self.job.spec.wire_dtype,
                    );
                    if let Err(e) = net.send(to, request) {
                        self.lost(net, e)?;
                    }
                }
                PairAction::Answer { to } => {
                    // Our model as it was, then the average.
                    let answer = ringtmp_collective::whole_model::model_message(
                        net,
                        &self.model,
                        iteration,
                        AVERAGE,
                        self.job.spec.wire_dtype,
                    );
                    self.average();
                    if let Err(e) = net.send(to, answer) {
                        self.lost(net, e)?;
                    }
                }
                PairAction::Average => self.average(),
                PairAction::Finished { to } => {
                    let done = AdpsgdMessage::Finished {
                        iterations: iteration,
                    };
                    if let Err(e) = net.send(to, done.to_message()) {
                        self.lost(net, e)?;
                    }
                }
                // Only a lost link makes a neighbour leave (`lost` reports it, with the cause).
                PairAction::Left { .. } => {}
                PairAction::Fail(why) => {
                    return Err(Error::protocol("ad-psgd", net, from, &why));
                }
            }
        }
        Ok(())
    }

    /// Replaces our model by its average with the one received.
    fn average(&mut self) {
        self.model
            .iter_mut()
            .zip(&self.received)
            .for_each(|(x, a)| *x = (*x + a) * 0.5);
        self.averagings += 1;
    }

    fn coordinator_mut(&mut self) -> &mut Coordinator {
        self.coordinator.as_mut().expect("rank 0 coordinates")
    }

    /// A transport failure: a dead worker is dropped (its neighbours go on without it); the
    /// master's death, or anything else, ends the run.
    fn lost(&mut self, net: &dyn Transport, e: TransportError) -> Result<()> {
        let Some(dead) = e.failed_peer() else {
            return Err(e.into());
        };
        let actions = self.pairing.handle_lost(dead, &e.to_string());
        if actions.iter().any(|a| matches!(a, PairAction::Fail(_))) {
            return Err(e.into());
        }
        let reported = match self.coordinator.as_mut() {
            Some(c) => c.drop_worker(dead, e.to_string()),
            None => false,
        };
        if !actions.is_empty() || reported {
            self.notices.push(format!(
                "ad-psgd: rank {}: {} left the run ({e}); going on without it",
                self.rank,
                net.peer_name(dead)
            ));
        }
        Ok(())
    }

    /// Handles everything that has already arrived.
    fn drain(&mut self, net: &mut dyn Transport) -> Result<()> {
        loop {
            match net.try_recv() {
                Ok(Some((from, m))) => self.handle(net, from, m)?,
                Ok(None) => return Ok(()),
                Err(e) => self.lost(net, e)?,
            }
        }
    }

    /// Waits for the next message and handles it.
    fn serve_one(&mut self, net: &mut dyn Transport, wait: Duration) -> Result<()> {
        match net.recv(wait) {
            Ok((from, m)) => self.handle(net, from, m),
            Err(e) => self.lost(net, e),
        }
    }
}

/// What computing a gradient needs (kept apart from [`Worker`]).
struct Compute<'a> {
    spec: &'a RunSpec,
    data: &'a Dataset,
    stage: Stage,
    plan: BatchPlan,
    share: ShareBuffers,
    rank: u32,
    workers: usize,
    speed: f64,
}

impl Compute<'_> {
    /// The gradient of this worker's share of global batch `step` at `model`, left in the
    /// stage; accounts the compute on `clock`. Returns the loss and the compute's measured time.
    fn gradient(
        &mut self,
        model: &[f32],
        step: u64,
        clock: &dyn ringtmp_transport::Clock,
    ) -> Result<f64> {
        let wall = Instant::now();
        // One pass over the model (recorded for the simulator's cost model; skipped in its
        // sizes-only runs, where the copy would back every node's model with memory).
        ringtmp_meter::elementwise(model.len());
        if !ringtmp_meter::phantom() {
            self.stage.params_mut().copy_from_slice(model);
        }
        let loss = crate::replicas::forward_share(
            self.spec,
            &mut self.plan,
            self.data,
            &mut self.stage,
            self.rank,
            self.workers,
            step,
            &mut self.share,
        )?;
        self.stage.backward(0, &self.share.dlogits)?;
        // Materialise the gradient here, on the compute thread.
        self.stage.grads();
        if let Some(max_norm) = self.spec.clip_grad_norm {
            // This worker's own gradient, the one it applies (there is no other in AD-PSGD).
            ringtmp_contract::clipping::clip_whole(&mut self.stage, max_norm);
        }
        clock.computed(wall.elapsed(), self.speed);
        Ok(loss)
    }
}

/// Runs worker `rank` of `job` (from `initial` instead of the seed's model when given: tests of
/// the gossip itself start the workers apart).
pub fn run_worker(
    job: &AdpsgdJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
    initial: Option<&[f32]>,
) -> Result<WorkerOutcome> {
    let spec = &job.spec;
    let n = job.workers as u32;
    let (layers, mut me, mut compute, mut optimizer) = open_worker(job, rank, data, initial)?;
    let actives = mixing::two_colouring(n, |r| mixing::bipartite_neighbours(r, n))
        .map_or(0, |colours| {
            colours.iter().filter(|passive| !**passive).count()
        });
    let recorder = crate::replicas::open_recorder(
        spec,
        NAME,
        rank,
        me.model.len(),
        json!({"workers": n, "active": actives, "degree": me.pairing.near().len()}),
        on_event,
    )?;
    let started = net.clock().now();
    let mut rank0 = recorder.map(|recorder| Rank0 {
        recorder,
        layers: &layers,
        data,
        started,
    });
    let mut times = Times::default();
    let iterations = iterate(
        &mut me,
        &mut compute,
        &mut optimizer,
        net,
        rank0.as_mut(),
        &mut times,
        on_event,
    )?;
    // The end: actives release their passive neighbours; passives serve until released.
    let clock = net.clock();
    let waited = clock.now();
    let release = me.pairing.handle_end();
    me.act(net, rank, iterations, release)?;
    while !me.pairing.released() {
        me.serve_one(net, spec.recv_timeout())?;
    }
    times.wait += (clock.now() - waited).as_secs_f64();
    for text in me.notices.drain(..) {
        on_event(&ringtmp_contract::Event::Notice { text });
    }
    // Rank 0's evaluations pause it alone while the others train on: its wall time counts.
    let train_seconds = (clock.now() - started).as_secs_f64();
    let mut stage = compute.stage;
    if !ringtmp_meter::phantom() {
        stage.params_mut().copy_from_slice(&me.model);
    }
    let own_accuracy =
        ringtmp_contract::evaluation::evaluate(&mut stage, &data.test, data.classes)?.accuracy;
    let own = NodeSummary {
        test_accuracy: Some(own_accuracy),
        ..crate::replicas::worker_summary(
            rank,
            &stage,
            &optimizer,
            net,
            &WorkerClock {
                train_seconds,
                compute_seconds: times.compute,
                wait_seconds: times.wait,
                iterations,
                samples: 0,
            },
        )
    };
    let Some(r0) = rank0 else {
        net.send(
            0,
            ringtmp_collective::whole_model::model_message(
                net,
                &me.model,
                FINAL,
                SNAPSHOT,
                Dtype::F32,
            ),
        )?;
        let doc = serde_json::to_string(&own).map_err(|e| Error::Config(e.to_string()))?;
        net.send(0, Message::Control(Control::Report { nodes: vec![doc] }))?;
        return Ok(WorkerOutcome {
            model: me.model,
            averagings: me.averagings,
            summary: None,
        });
    };
    let summary = finish_rank0(
        &mut me,
        net,
        r0,
        stage,
        &optimizer,
        own,
        train_seconds,
        on_event,
    )?;
    Ok(WorkerOutcome {
        model: me.model,
        averagings: me.averagings,
        summary: Some(summary),
    })
}

/// A worker's opening: the model's layers, the state messages act on (its pairing, its model),
/// its compute state (the replica it computes gradients with) and its optimizer.
fn open_worker<'a>(
    job: &'a AdpsgdJob,
    rank: u32,
    data: &'a Dataset,
    initial: Option<&[f32]>,
) -> Result<(
    Vec<ringtmp_model::Layer>,
    Worker<'a>,
    Compute<'a>,
    Optimizer,
)> {
    let spec = &job.spec;
    let n = job.workers as u32;
    let allowed = Coordinator::initial_grant(n, spec.first_step(), spec.total_steps);
    let pairing = Pairing::new(rank, n, allowed)
        .ok_or_else(|| Error::Config(format!("{n} workers: the graph is not bipartite")))?;
    let (layers, stage, optimizer) = spec.open_replica()?;
    let compute = Compute {
        spec,
        data,
        stage,
        plan: BatchPlan::new(data.train.len(), spec.batch_size * n as usize, spec.seed)?,
        share: ShareBuffers::default(),
        rank,
        workers: n as usize,
        speed: job.node_speeds.get(rank as usize).copied().unwrap_or(1.0),
    };
    let me = Worker {
        job,
        rank,
        pairing,
        model: match initial {
            Some(model) => model.to_vec(),
            // A sizes-only run's model: zeroed, never written, so never backed by memory.
            None if ringtmp_meter::phantom() => vec![0.0; compute.stage.params().len()],
            None => compute.stage.params().to_vec(),
        },
        notices: Vec::new(),
        averagings: 0,
        coordinator: (rank == 0).then(|| Coordinator::new(n, spec.first_step(), spec.total_steps)),
        finals: Vec::new(),
        reports: Vec::new(),
        received: Vec::new(),
    };
    Ok((layers, me, compute, optimizer))
}

/// The worker's iterations at its own pace until rank 0 says stop (rank 0 coordinating
/// between them); returns how many it did.
fn iterate(
    me: &mut Worker<'_>,
    compute: &mut Compute<'_>,
    optimizer: &mut Optimizer,
    net: &mut dyn Transport,
    mut rank0: Option<&mut Rank0<'_>>,
    times: &mut Times,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<u64> {
    let spec = &me.job.spec;
    let rank = me.rank;
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed ^ (u64::from(rank) << 32) ^ 0xAD_95_6D);
    let mut iterations = 0u64;
    let timeout = spec.recv_timeout();
    let last_rate_step = spec.schedule_steps.saturating_sub(1);
    loop {
        me.drain(net)?;
        for text in me.notices.drain(..) {
            on_event(&ringtmp_contract::Event::Notice { text });
        }
        if let Some(r0) = rank0.as_deref_mut() {
            coordinate(me, net, r0, optimizer, on_event)?;
        }
        if me.pairing.stopped() {
            return Ok(iterations);
        }
        if !me.pairing.may_iterate(iterations) {
            // This worker's grant is used up: serve the others until rank 0 grants more or says
            // stop (a silent rank 0 is named by the timeout).
            me.serve_one(net, timeout)?;
            continue;
        }
        let step = spec.first_step() + iterations;
        let lr = spec.lr_at(step.min(last_rate_step));
        let draw = |count| rng.random_range(0..count);
        let loss = gradient_while_pairing(me, compute, net, iterations, draw, times)?;
        if !me.pairing.active() {
            me.drain(net)?;
        }
        // The gradient, computed on the model read, applied to the model as it is now.
        optimizer.step(&mut me.model, compute.stage.grads(), lr, spec.threads);
        compute.stage.zero_grad();
        iterations += 1;
        if !loss.is_finite() {
            return Err(Error::Diverged { step, loss });
        }
        match me.coordinator.as_mut() {
            Some(c) => c.progress(0, iterations, loss),
            None => {
                let progress = AdpsgdMessage::Progress {
                    iterations,
                    loss_bits: loss.to_bits(),
                };
                net.send(0, progress.to_message())?;
            }
        }
    }
}

/// Seconds a worker spent computing and waiting for its partners.
#[derive(Default)]
struct Times {
    compute: f64,
    wait: f64,
}

/// One iteration's gradient at this worker's model, with the pairing around it: an active
/// worker sends its model to the partner `draw` picks among its live passive neighbours,
/// computes while it travels, then waits for the answer and averages; a passive worker answers
/// requests while it computes (on a thread of its own, on a wall clock; after it, on a virtual
/// one). Returns the loss; the gradient is left in `compute`'s stage.
fn gradient_while_pairing(
    me: &mut Worker<'_>,
    compute: &mut Compute<'_>,
    net: &mut dyn Transport,
    iterations: u64,
    draw: impl FnOnce(usize) -> usize,
    times: &mut Times,
) -> Result<f64> {
    let clock = net.clock();
    let timeout = me.job.spec.recv_timeout();
    let step = me.job.spec.first_step() + iterations;
    let t0 = clock.now();
    if me.pairing.active() {
        let request = me.pairing.handle_iteration(iterations, draw);
        me.act(net, me.rank, iterations, request)?;
        let loss = compute.gradient(&me.model, step, clock.as_ref())?;
        times.compute += (clock.now() - t0).as_secs_f64();
        let waited = clock.now();
        while let Some(partner) = me.pairing.awaiting() {
            match net.recv_from(partner, timeout) {
                Ok(m) => me.handle(net, partner, m)?,
                Err(e) => me.lost(net, e)?,
            }
        }
        times.wait += (clock.now() - waited).as_secs_f64();
        return Ok(loss);
    }
    let loss = if clock.overlaps_compute() {
        let model = me.model.clone();
        std::thread::scope(|s| -> Result<f64> {
            let clock = clock.as_ref();
            let job = s.spawn(|| compute.gradient(&model, step, clock));
            while !job.is_finished() {
                me.serve_one(net, POLL).or_else(|e| match e {
                    Error::Transport(TransportError::Timeout { .. }) => Ok(()),
                    e => Err(e),
                })?;
            }
            job.join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })?
    } else {
        compute.gradient(&me.model, step, clock.as_ref())?
    };
    times.compute += (clock.now() - t0).as_secs_f64();
    Ok(loss)
}

/// Rank 0's end of the run: every live worker's final model and report (and any gathering
/// round still in flight), their consensus evaluated (and checkpointed when due), and the run's
/// summary written.
fn finish_rank0(
    me: &mut Worker<'_>,
    net: &mut dyn Transport,
    mut r0: Rank0<'_>,
    mut stage: Stage,
    optimizer: &Optimizer,
    own: NodeSummary,
    train_seconds: f64,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<Summary> {
    let (spec, n, data) = (&me.job.spec, me.job.workers as u32, r0.data);
    let timeout = spec.recv_timeout();
    let clock = net.clock();
    let started = r0.started;
    // Rank 0: every live worker's final model and report (and any round still in flight).
    loop {
        let c = me.coordinator.as_ref().expect("rank 0 coordinates");
        let live: Vec<u32> = c.live().iter().copied().filter(|r| *r != 0).collect();
        let have = |r: &u32| me.reports.iter().any(|p| p.rank == *r);
        if live.iter().all(have) && live.iter().all(|r| me.finals.iter().any(|f| f.0 == *r)) {
            break;
        }
        me.serve_one(net, timeout)?;
        coordinate(me, net, &mut r0, optimizer, on_event)?;
    }
    let c = me.coordinator.take().expect("rank 0 coordinates");
    let live = c.live().clone();
    let mut finals: Vec<(u32, Vec<f32>)> = vec![(0, me.model.clone())];
    finals.extend(
        std::mem::take(&mut me.finals)
            .into_iter()
            .filter(|(r, _)| live.contains(r)),
    );
    finals.sort_by_key(|(r, _)| *r);
    let done = c.global_step();
    let (mean, distance) = super::consensus::consensus(&finals);
    stage.params_mut().copy_from_slice(&mean);
    let score = ringtmp_contract::evaluation::evaluate(&mut stage, &data.test, data.classes)?;
    let wall = (clock.now() - started).as_secs_f64();
    // The run's last evaluation: its checkpoint follows anyway.
    let _ = r0
        .recorder
        .announce_eval(done, score, train_seconds, wall, on_event)?;
    r0.recorder
        .write(json!({"event": "consensus", "step": done, "distance": distance}))?;
    if spec.checkpoint_due(done) {
        let replicas: Vec<(u32, &[f32])> = finals.iter().map(|(r, m)| (*r, &m[..])).collect();
        let dir = crate::replicas::write_model(
            spec, n as usize, NAME, &stage, optimizer, done, &replicas,
        )?;
        r0.recorder.announce_checkpoint(done, dir, on_event)?;
    }
    let mut per_node = std::mem::take(&mut me.reports);
    per_node.push(own);
    per_node.sort_by_key(|p| p.rank);
    let samples = c.iterations() * spec.batch_size as u64;
    let totals = crate::replicas::RunTotals {
        params: mean.len() as u64,
        steps: done,
        samples,
        samples_from_reports: false,
        wall_seconds: wall,
        train_seconds,
    };
    let summary = Summary {
        consensus_distance: Some(distance),
        dropped_nodes: c.dropped().to_vec(),
        ..crate::replicas::run_summary(&r0.recorder, NAME, n, &totals, per_node)
    };
    r0.recorder.finish(summary)
}

/// What rank 0 keeps for coordinating: its recorder and what evaluating needs.
struct Rank0<'a> {
    recorder: ringtmp_contract::recorder::RunRecorder,
    layers: &'a [ringtmp_model::Layer],
    data: &'a Dataset,
    started: Duration,
}

/// Rank 0 acts on the progress so far: records steps, gathers models and evaluates or
/// checkpoints their average when a round completes, and gives the order to stop.
fn coordinate(
    me: &mut Worker<'_>,
    net: &mut dyn Transport,
    r0: &mut Rank0<'_>,
    optimizer: &Optimizer,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<()> {
    let spec = &me.job.spec;
    let clock = net.clock();
    let elapsed = || (clock.now() - r0.started).as_secs_f64();
    for (rank, iterations) in me.coordinator_mut().grants() {
        if rank == 0 {
            me.pairing.handle_allow(0, iterations);
        } else if let Err(e) = net.send(rank, AdpsgdMessage::Allow { iterations }.to_message()) {
            me.lost(net, e)?;
        }
    }
    let actions = me.coordinator_mut().actions(|s| gathering_due(spec, s));
    for action in actions {
        match action {
            Action::Record { step, loss } => {
                let lr = spec.lr_at(step - 1);
                let samples = me.coordinator_mut().iterations() * spec.batch_size as u64;
                net.step_done();
                r0.recorder
                    .announce_step(step, loss, lr, (elapsed(), samples), on_event)?;
            }
            Action::Snapshot { round, ranks } => {
                for r in ranks {
                    if let Err(e) = net.send(r, AdpsgdMessage::Snapshot { round }.to_message()) {
                        me.lost(net, e)?;
                    }
                }
                let model = me.model.clone();
                me.coordinator_mut().own_snapshot(&model);
            }
            Action::Stop => {
                let step = me.coordinator_mut().global_step();
                let live: Vec<u32> = me.coordinator_mut().live().iter().copied().collect();
                for r in live.into_iter().filter(|r| *r != 0) {
                    if let Err(e) = net.send(r, AdpsgdMessage::Stop { step }.to_message()) {
                        me.lost(net, e)?;
                    }
                }
                me.pairing.handle_stop(0);
            }
        }
    }
    let Some(round) = me.coordinator_mut().completed_round() else {
        return Ok(());
    };
    let models: Vec<(u32, Vec<f32>)> = round.models.into_iter().collect();
    let (mean, distance) = super::consensus::consensus(&models);
    let mut stage = Stage::new(r0.layers, 0..r0.layers.len(), spec.seed, spec.threads);
    stage.params_mut().copy_from_slice(&mean);
    let done = round.step;
    let mut verdict = ringtmp_contract::recorder::Verdict::default();
    if spec.eval_due(done) {
        let score =
            ringtmp_contract::evaluation::evaluate(&mut stage, &r0.data.test, r0.data.classes)?;
        verdict = r0
            .recorder
            .announce_eval(done, score, elapsed(), elapsed(), on_event)?;
    }
    r0.recorder
        .write(json!({"event": "consensus", "step": done, "distance": distance}))?;
    if spec.checkpoint_due(done) || verdict.checkpoint {
        let replicas: Vec<(u32, &[f32])> = models.iter().map(|(r, m)| (*r, &m[..])).collect();
        let dir = crate::replicas::write_model(
            spec,
            me.job.workers,
            NAME,
            &stage,
            optimizer,
            done,
            &replicas,
        )?;
        r0.recorder.announce_checkpoint(done, dir, on_event)?;
    }
    Ok(())
}
