//! The master of a ring (rank 0): the data and the labels, stage 0, the loss, evaluation,
//! checkpoints and the run's outputs. Stage 0 runs one loop under every schedule ([`MasterPipe`]);
//! the loss side is one machine whose only schedule-dependent part is its [`LossPolicy`].

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use ringtmp_data::{BatchPlan, Dataset, shard};
use ringtmp_metrics::Summary;
use ringtmp_model::{Optimizer, Pass, Stage};
use ringtmp_transport::Transport;
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Control, Dtype, Message, TensorTag};
use serde_json::{Value, json};

use crate::heal::replicas::{REPLICA, Replicas, Snapshot};
use crate::net::RingNet;
use crate::run::driver::{NodeClock, RingJob, micro_offset, node_summary, protocol, tensor};
use crate::run::messages::{Incoming, RingMessage};
use crate::run::schedule::{Action, Schedule, StageState};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::event::Event;
use ringtmp_contract::messages::StrategyMessage;
use ringtmp_contract::recorder::{RunRecorder, Verdict};

/// What the master needs besides the job: the data and where to write.
pub struct MasterSetup<'a> {
    /// The dataset (only the master has it).
    pub data: &'a Dataset,
}

/// What the master returns: the run's summary and its final stages.
pub struct MasterOutcome {
    /// The summary also written to `summary.json`.
    pub summary: Summary,
    /// Stage 0.
    pub stage: Stage,
    /// The head, when the master held it.
    pub head: Option<Stage>,
}

/// Runs the master (rank 0): data, stage 0, loss, evaluation, outputs.
/// Returns the summary and the master's stages (their final parameters).
pub fn run_master(
    job: &RingJob,
    setup: &MasterSetup<'_>,
    net: &mut dyn RingNet,
    on_event: &mut dyn FnMut(&Event),
) -> Result<MasterOutcome> {
    let mut record = RunRecord::default();
    run_master_with(
        job,
        setup,
        net,
        on_event,
        None,
        &mut Replicas::default(),
        &mut record,
    )
}

/// The run's record on the master, kept across the rings a heal forms (`heal::run` owns it):
/// one event log, and clocks and counters that cover the whole run.
#[derive(Default)]
pub struct RunRecord {
    recorder: Option<RunRecorder>,
    /// The run's start on the master's clock.
    started: Option<std::time::Duration>,
    /// This process's training seconds and samples so far (steps trained again after a heal
    /// included; the recorder adds a restarted run's earlier attempts).
    train_seconds: f64,
    samples: u64,
}

/// [`run_master`] from `initial` (a healed ring's in-memory state) instead of the job's start or
/// checkpoint, running replication rounds into `replicas` (`--stage-replicas`) and continuing
/// `record` (a healed ring's: a `heal` event instead of a new start).
pub fn run_master_with(
    job: &RingJob,
    setup: &MasterSetup<'_>,
    net: &mut dyn RingNet,
    on_event: &mut dyn FnMut(&Event),
    initial: Option<&Snapshot>,
    replicas: &mut Replicas,
    record: &mut RunRecord,
) -> Result<MasterOutcome> {
    let time = net.clock();
    let wall = *record.started.get_or_insert_with(|| time.now());
    let (mut stage, plan) = job.stage(0)?;
    let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), stage.params().len());
    stage.set_weight_stashing(job.schedule == Schedule::Async);
    match initial {
        Some(snapshot) => snapshot.restore(&mut stage, &mut optimizer)?,
        None => job.load(&mut stage, &mut optimizer)?,
    }
    let mut head = MasterHead::load(job)?;
    if let Some(h) = head.as_mut() {
        h.follow(&stage);
    }
    // Rings of rings draw the global batch and take their share of it.
    let mut batches = BatchPlan::new(
        setup.data.train.len(),
        job.spec.batch_size * job.replicas.max(1),
        job.spec.seed,
    )?;
    let mut clock = NodeClock::new(net, job.node_speeds.first().copied().unwrap_or(1.0));
    let since_wall = (time.now() - wall).as_secs_f64();
    let (mut train_seconds, mut samples) = (record.train_seconds, record.samples);
    let recorder = open_recorder(job, (&mut record.recorder, train_seconds), since_wall)?;
    let wall_seconds = |now: std::time::Duration| (now - wall).as_secs_f64();
    on_event(&started(job)?);

    let timeout = job.recv_timeout();
    let mut pipe = MasterPipe::new(job);
    let attempt_from = train_seconds;
    let mut steps_done = job.spec.total_steps;
    for step in job.first_step()..job.spec.total_steps {
        let t_step = time.now();
        let lr = job.lr_at(step);
        let (step_loss, rows_total) = pipe.run_minibatch(
            step,
            job.next_drain(step),
            job,
            setup,
            &mut batches,
            &mut stage,
            &mut optimizer,
            head.as_mut(),
            &mut clock,
            net,
        )?;
        train_seconds += (time.now() - t_step).as_secs_f64();
        samples += rows_total as u64;
        let mean_loss = step_loss / (rows_total * job.spec.positions()) as f64;
        if !mean_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: mean_loss,
            });
        }
        let done = step + 1;
        net.step_done();
        (record.train_seconds, record.samples) = (train_seconds, samples);
        recorder.announce_step(done, mean_loss, lr, (train_seconds, samples), on_event)?;
        // Rings of rings: the rings are identical, so the first evaluates and checkpoints.
        let mut verdict = Verdict::default();
        if job.ring == 0 && job.spec.eval_due(done) {
            let at = (done, train_seconds, wall_seconds(time.now()));
            verdict = evaluate_and_record(
                job,
                setup.data,
                &mut stage,
                head.as_mut(),
                net,
                &mut clock,
                at,
                recorder,
                on_event,
            )?;
        }
        // Checkpoints and replication rounds are the run's own cost (a fault-tolerance setting
        // that halves throughput must show it): on the training clock, unlike evaluations.
        let upkeep = time.now();
        // The best evaluation's checkpoint and an early stop's come after an evaluation, where
        // the async pipeline has drained.
        if job.ring == 0 && (job.checkpoint_due(done) || verdict.checkpoint) {
            let dir = checkpoint_round(job, net, done, (&stage, &optimizer), head.as_ref())?;
            recorder.announce_checkpoint(done, dir, on_event)?;
        }
        replicas.last_step = done;
        if job.replica_due(done) {
            replicate(
                job,
                net,
                done,
                (&stage, &optimizer, &plan),
                replicas,
                timeout,
            )?;
        }
        train_seconds += (time.now() - upkeep).as_secs_f64();
        record.train_seconds = train_seconds;
        if verdict.stop {
            steps_done = done;
            break;
        }
    }
    // A run resumed at its very end (a node died after the last step, before the summary) has
    // trained nothing here: it still evaluates, so its summary says where the run ended.
    if job.first_step() == job.spec.total_steps && job.ring == 0 && job.spec.total_steps > 0 {
        let at = (
            job.spec.total_steps,
            train_seconds,
            wall_seconds(time.now()),
        );
        let _ = evaluate_and_record(
            job,
            setup.data,
            &mut stage,
            head.as_mut(),
            net,
            &mut clock,
            at,
            recorder,
            on_event,
        )?;
    }
    // Collect every node's measurements around the ring.
    let mut own = node_summary(
        0,
        "master",
        &stage,
        &optimizer,
        &plan,
        &clock,
        train_seconds - attempt_from,
        &net.stats(),
    );
    if let Some(h) = &head {
        h.count_in(&mut own);
    }
    let per_node = collect_reports(job, net, own)?;
    let summary = Summary {
        wall_seconds: recorder.carried().wall_seconds + wall_seconds(time.now()),
        steps: steps_done,
        ..ring_summary(job, recorder, per_node, (train_seconds, samples))?
    };
    let summary = match record.recorder.take() {
        Some(recorder) => recorder.finish(summary)?,
        None => summary,
    };
    Ok(MasterOutcome {
        summary,
        stage,
        head: head.map(|h| h.stage),
    })
}

/// The run's recorder: a healed ring's, continued with a `heal` event (`since_wall` seconds into
/// this attempt), or a new one.
fn open_recorder<'r>(
    job: &RingJob,
    (slot, trained): (&'r mut Option<RunRecorder>, f64),
    since_wall: f64,
) -> Result<&'r mut RunRecorder> {
    let n = job.partition.len() as u32;
    let ring = json!({"schedule": job.schedule.name(), "nodes": n,
        "micro_batches": job.micro_batches, "partition": job.partition});
    let Some(recorder) = slot else {
        return Ok(slot.insert(RunRecorder::open(&job.spec, "ring", ring)?));
    };
    let carried = recorder.carried();
    let mut event = json!({"event": "heal", "first_step": job.first_step(),
        "train_seconds": carried.train_seconds + trained,
        "wall_seconds": carried.wall_seconds + since_wall});
    if let (Some(e), Value::Object(extra)) = (event.as_object_mut(), ring) {
        e.extend(extra);
    }
    recorder.write(event)?;
    Ok(recorder)
}

/// The run's start as the user is told it: its steps and parameters, and every stage's (the
/// master's with the head it holds).
fn started(job: &RingJob) -> Result<Event> {
    let layers = job.layers()?;
    let count = |start: usize, end: usize| -> usize {
        layers[start..end].iter().map(|l| l.param_count()).sum()
    };
    Ok(Event::Started {
        total_steps: job.spec.total_steps,
        first_step: job.first_step(),
        params: count(0, layers.len()),
        stage_params: job
            .partition
            .iter()
            .map(|p| count(p.start, p.end))
            .enumerate()
            .map(|(i, c)| match (&job.head, i) {
                (Some(h), 0) => c + count(h.start, h.end),
                _ => c,
            })
            .collect(),
    })
}

/// A checkpoint after mini-batch `done`, around the ring: each node writes its stage file and
/// appends its entry to the token; the master writes the head's file and then the manifest, so
/// an interrupted checkpoint leaves the previous one intact. Returns the checkpoint's directory.
fn checkpoint_round(
    job: &RingJob,
    net: &mut dyn RingNet,
    done: u64,
    (stage, optimizer): (&Stage, &Optimizer),
    head: Option<&MasterHead>,
) -> Result<std::path::PathBuf> {
    let n = job.partition.len() as u32;
    let own = job.write_stage_file(0, done, stage, optimizer)?;
    let token = Control::Checkpoint {
        step: done,
        files: vec![own],
    };
    let mut files = match token_round(net, n, token, job.recv_timeout())? {
        Control::Checkpoint { step, files } if step == done && files.len() == n as usize => files,
        _ => {
            return Err(protocol(
                net,
                n - 1,
                "message instead of the checkpoint entries",
            ));
        }
    };
    if let Some(h) = head {
        files.push(job.write_stage_file_named("stage-head", done, &h.stage, &h.optimizer)?);
    }
    job.write_manifest(done, &files)
}

/// Every node's report, collected around the ring after the master's own.
fn collect_reports(
    job: &RingJob,
    net: &mut dyn RingNet,
    own: ringtmp_metrics::NodeSummary,
) -> Result<Vec<ringtmp_metrics::NodeSummary>> {
    let n = job.partition.len() as u32;
    let mut per_node = vec![own];
    match token_round(
        net,
        n,
        Control::Report { nodes: Vec::new() },
        job.recv_timeout(),
    )? {
        Control::Report { nodes } => {
            for doc in nodes {
                per_node
                    .push(serde_json::from_str(&doc).map_err(|e| {
                        Error::Config(format!("a node's report is not valid: {e}"))
                    })?);
            }
        }
        _ => return Err(protocol(net, n - 1, "message instead of the final report")),
    }
    Ok(per_node)
}

/// The run's summary from the nodes' reports and this process's training seconds and samples
/// (the recorder adds earlier attempts' and healed rings'); the caller adds the wall time.
fn ring_summary(
    job: &RingJob,
    recorder: &RunRecorder,
    per_node: Vec<ringtmp_metrics::NodeSummary>,
    (train_seconds, samples): (f64, u64),
) -> Result<Summary> {
    let n = job.partition.len() as u32;
    let total_bytes_sent: u64 = per_node.iter().map(|p| p.bytes_sent).sum();
    let per_node_eval: u64 = per_node.iter().map(|p| p.eval_bytes_sent).sum();
    let model_params = job.layers()?.iter().map(|l| l.param_count() as u64).sum();
    let (m, nn) = (job.micro_batches as f64, f64::from(n));
    // The whole run's clocks and samples: every ring a heal formed in this process, and a
    // restarted run's earlier attempts (the bytes are this process's, so per its samples).
    let (run_seconds, run_samples) = recorder.run_figures(train_seconds, samples);
    Ok(Summary {
        schedule: Some(job.schedule.name().into()),
        model_params,
        micro_batches: job.micro_batches as u32,
        steps: job.spec.total_steps,
        samples: run_samples,
        train_seconds: run_seconds,
        samples_per_second: run_samples as f64 / run_seconds.max(1e-9),
        total_bytes_sent,
        bytes_per_sample: (total_bytes_sent - per_node_eval) as f64 / samples.max(1) as f64,
        theoretical_bubble_fraction: Some((nn - 1.0) / (m + nn - 1.0)),
        partition: job
            .partition
            .iter()
            .map(|p| serde_json::to_value(p).unwrap_or_default())
            .collect(),
        per_node,
        ..recorder.summary("ring", n)
    })
}

/// Evaluates the model after mini-batch `done` around the ring and records it: `at` is
/// (`done`, training seconds, wall seconds).
fn evaluate_and_record(
    job: &RingJob,
    data: &ringtmp_data::Dataset,
    stage: &mut Stage,
    head: Option<&mut MasterHead>,
    net: &mut dyn RingNet,
    clock: &mut NodeClock,
    (done, train_seconds, wall_seconds): (u64, f64, f64),
    recorder: &mut RunRecorder,
    on_event: &mut dyn FnMut(&Event),
) -> Result<Verdict> {
    let score = evaluate(job, data, stage, net, done, &mut clock.eval_bytes, head)?;
    recorder.announce_eval(done, score, train_seconds, wall_seconds, on_event)
}

/// A replication round after mini-batch `done` (see `heal`): the master keeps its own snapshot
/// and orders every node at once to send its snapshot to its predecessor; the round is complete
/// when node 1's replica (then its token) is in and every node has said that its successor's
/// replica reached it. All links carry their snapshot at the same time, so a round takes about
/// the largest stage's transfer, not the sum of all of them.
fn replicate(
    job: &RingJob,
    net: &mut dyn RingNet,
    done: u64,
    (stage, optimizer, plan): (&Stage, &Optimizer, &crate::plan::partition::StagePlan),
    replicas: &mut Replicas,
    timeout: Duration,
) -> Result<()> {
    let n = job.partition.len() as u32;
    replicas.keep_own(
        Snapshot::take(done, plan.start..plan.end, stage, optimizer)
            .with_outer_velocity(net.replica_outer_state()),
    );
    for r in 1..n {
        net.send(r, RingMessage::Replicate { step: done }.to_message())?;
    }
    let next = &job.partition[1];
    let layers = job.layers()?;
    let mut replica = false;
    // Node 1 sends its token (after its replica) and its own word; every other node its word.
    // Node 1's word may come first: its successor's token can reach it before this order does
    // (they travel on different links), and it passes the word on at once. Its token cannot
    // overtake its replica (one link), so two Replicates and the replica, in any order of word
    // and replica, complete its part.
    let mut said = vec![0u32; n as usize];
    let expected = |r: usize| if r == 1 { 2 } else { 1 };
    while !(replica && (1..n as usize).all(|r| said[r] == expected(r))) {
        let (from, message) = net.recv(timeout)?;
        match (from, Incoming::read(message, net, from)?) {
            (1, Incoming::Wire(Message::Tensor(h, bytes)))
                if h.tag == TensorTag::Params
                    && h.micro_batch == REPLICA
                    && h.step == done
                    && !replica =>
            {
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                let snapshot = Snapshot::from_values(
                    done,
                    next.start..next.end,
                    &layers,
                    &job.spec.optimizer,
                    optimizer.steps(),
                    &values,
                )
                .ok_or_else(|| protocol(net, 1, "replica of the wrong size"))?;
                replicas.keep_succ(snapshot);
                replica = true;
            }
            (from, Incoming::Own(RingMessage::Replicate { step }))
                if step == done
                    && (1..n).contains(&from)
                    && said[from as usize] < expected(from as usize) =>
            {
                said[from as usize] += 1;
            }
            (from, incoming) => {
                return Err(protocol(
                    net,
                    from,
                    &format!(
                        "{} during the replication round of mini-batch {done}",
                        incoming.describe()
                    ),
                ));
            }
        }
    }
    replicas.completed = Some(done);
    replicas.completed_at = Some(net.clock().now());
    Ok(())
}

/// Sends `count` tokens around the ring from the master, at most `window` of them on their way at
/// once, and hands each back to `returned` as it arrives, every node having done its part
/// ([`RingNode::serve`](crate::run::worker) is the other half): evaluation chunks (each node forwards
/// them through its stage), a checkpoint's entries and the final report (each node adds its
/// own). The one mechanism for everything that travels around the ring besides training.
fn around_the_ring(
    net: &mut dyn RingNet,
    n: u32,
    (count, window): (usize, usize),
    timeout: Duration,
    next: &mut dyn FnMut(usize) -> Result<Message>,
    returned: &mut dyn FnMut(&mut dyn RingNet, Message) -> Result<()>,
) -> Result<()> {
    let (succ, pred) = (1 % n, n - 1);
    let (mut sent, mut back) = (0, 0);
    while back < count {
        if sent < count && sent - back < window.max(1) {
            let token = next(sent)?;
            net.send(succ, token)?;
            sent += 1;
            continue;
        }
        let message = net.recv_from(pred, timeout)?;
        returned(net, message)?;
        back += 1;
    }
    Ok(())
}

/// One control token once around the ring; what comes back.
fn token_round(
    net: &mut dyn RingNet,
    n: u32,
    token: Control,
    timeout: Duration,
) -> Result<Control> {
    let pred = n - 1;
    let mut token = Some(token);
    let mut back = None;
    around_the_ring(
        net,
        n,
        (1, 1),
        timeout,
        &mut |_| {
            token
                .take()
                .map(Message::Control)
                .ok_or_else(|| Error::Config("a token is sent once".into()))
        },
        &mut |net, message| match message {
            Message::Control(c @ (Control::Checkpoint { .. } | Control::Report { .. })) => {
                back = Some(c);
                Ok(())
            }
            _ => Err(protocol(
                net,
                pred,
                "message instead of the token going round",
            )),
        },
    )?;
    back.ok_or_else(|| protocol(net, pred, "no token"))
}

/// How the master's loss side keys and scales micro-batches: the one difference between the
/// flushed schedules and `async` on the master's side of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LossPolicy {
    /// `gpipe`/`1f1b`: micro-batches `0..M` of mini-batch `step`, every loss scaled by the whole
    /// mini-batch, one step at the flush.
    Flushed { step: u64, rows_total: usize },
    /// `async`: micro-batch `k` of the run (`k mod M` of mini-batch `k div M`), each its own SGD
    /// step: loss scaled by its own rows, the head steps after each.
    Async { micro_batches: u64 },
}

impl LossPolicy {
    /// Whether a training tensor tagged `step` belongs to the work in progress.
    fn accepts(&self, step: u64) -> bool {
        match self {
            Self::Flushed { step: now, .. } => step == *now,
            Self::Async { .. } => true,
        }
    }

    /// The mini-batch micro-batch `id` belongs to.
    fn step_of(&self, id: u64) -> u64 {
        match *self {
            Self::Flushed { step, .. } => step,
            Self::Async { micro_batches } => id / micro_batches,
        }
    }

    /// The header step of tensors about micro-batch `id`.
    fn header_step(&self, id: u64) -> u64 {
        match *self {
            Self::Flushed { step, .. } => step,
            Self::Async { .. } => id,
        }
    }

    /// What a micro-batch of `rows` rows' loss gradient is scaled by.
    fn scale(&self, rows: usize) -> f32 {
        match *self {
            Self::Flushed { rows_total, .. } => 1.0 / rows_total.max(1) as f32,
            Self::Async { .. } => 1.0 / rows.max(1) as f32,
        }
    }
}

/// The master's loss side, one machine under every schedule: the last node's output for a
/// micro-batch goes through the head (when the master holds it), the loss with the labels only
/// the master has, and its gradient goes back; a gradient from rank 1 is queued for stage 0.
struct LossSide {
    policy: LossPolicy,
    /// Labels and the pass (dropout seed, rows' place) of every micro-batch forwarded and not yet
    /// scored, by micro-batch id.
    pending: BTreeMap<u64, (Vec<u32>, Pass)>,
    /// Gradients from rank 1 waiting for stage 0's backward.
    grads: VecDeque<(u64, Vec<f32>)>,
    /// Summed loss per mini-batch.
    losses: BTreeMap<u64, f64>,
    /// Losses computed so far.
    scored: u64,
    values: Vec<f32>,
    /// Gradient clipping: the other stages' summed squared norm of a mini-batch, which may
    /// arrive while stage 0 still runs its last backward.
    grad_norm: Option<(u64, f64)>,
    /// `async` with a tied head: the head's gradient of the table per micro-batch, waiting for
    /// stage 0's backward of the same micro-batch (the matrix's one update takes both).
    tied_grads: BTreeMap<u64, Vec<f32>>,
}

impl LossSide {
    fn new(policy: LossPolicy) -> Self {
        Self {
            policy,
            pending: BTreeMap::new(),
            grads: VecDeque::new(),
            losses: BTreeMap::new(),
            scored: 0,
            values: Vec::new(),
            grad_norm: None,
            tied_grads: BTreeMap::new(),
        }
    }

    /// Remembers what scoring micro-batch `id` needs once the last node's output comes back.
    fn forwarded(&mut self, id: u64, labels: Vec<u32>, pass: Pass) {
        self.pending.insert(id, (labels, pass));
    }

    /// Handles every message that has already arrived.
    fn drain(
        &mut self,
        job: &RingJob,
        net: &mut dyn RingNet,
        mut head: Option<&mut MasterHead>,
    ) -> Result<()> {
        while let Some((from, message)) = net.try_recv()? {
            self.handle_and_send(job, net, head.as_deref_mut(), from, message)?;
        }
        Ok(())
    }

    /// [`LossSide::handle`], then sends what it returns.
    fn handle_and_send(
        &mut self,
        job: &RingJob,
        net: &mut dyn RingNet,
        head: Option<&mut MasterHead>,
        from: u32,
        message: Message,
    ) -> Result<()> {
        if let Some((to, reply)) = self.handle(job, net, head, from, message)? {
            net.send(to, reply)?;
        }
        Ok(())
    }

    /// One arrival: the last node's output (→ head, loss, and the gradient to send back, which
    /// is returned) or a gradient for stage 0 (→ queued). Anything else is the sender's protocol
    /// error. The network is only read for naming the peer: the machine sends nothing itself.
    fn handle(
        &mut self,
        job: &RingJob,
        net: &dyn Transport,
        head: Option<&mut MasterHead>,
        from: u32,
        message: Message,
    ) -> Result<Option<(u32, Message)>> {
        let n = job.partition.len() as u32;
        let (succ, pred) = (1 % n, n - 1);
        match Incoming::read(message, net, from)? {
            Incoming::Wire(Message::Tensor(h, bytes))
                if from == pred
                    && h.tag == TensorTag::Activation
                    && self.policy.accepts(h.step) =>
            {
                let id = h.micro_batch;
                let (labels, pass) = self
                    .pending
                    .remove(&id)
                    .ok_or_else(|| protocol(net, from, "logits"))?;
                tensor_values(&bytes, h.dtype, &mut self.values);
                let mut head = head;
                let (loss_sum, grad) = loss_site(
                    job,
                    head.as_deref_mut(),
                    id,
                    &pass,
                    &self.values,
                    &labels,
                    self.policy.scale(labels.len()),
                )?;
                let step = self.policy.step_of(id);
                if let (LossPolicy::Async { .. }, Some(h)) = (self.policy, head) {
                    // Each async micro-batch is its own step, on the head too; a tied head's
                    // share of the table's gradient waits for stage 0's backward.
                    if h.tied() {
                        self.tied_grads.insert(id, h.stage.take_tied_grad());
                    }
                    h.stage.step(&mut h.optimizer, job.lr_at(step));
                }
                *self.losses.entry(step).or_default() += loss_sum;
                self.scored += 1;
                // One row per example (a window's labels are its positions').
                let back = tensor(
                    TensorTag::Gradient,
                    self.policy.header_step(id),
                    id,
                    labels.len() / job.spec.positions(),
                    &grad,
                    job.spec.wire_dtype,
                );
                Ok(Some((pred, back)))
            }
            Incoming::Wire(Message::Tensor(h, bytes))
                if from == succ && h.tag == TensorTag::Gradient && self.policy.accepts(h.step) =>
            {
                let mut dy = Vec::new();
                tensor_values(&bytes, h.dtype, &mut dy);
                self.grads.push_back((h.micro_batch, dy));
                Ok(None)
            }
            Incoming::Own(RingMessage::GradNorm {
                step,
                sum_squares_bits,
            }) if from == succ
                && job.spec.clip_grad_norm.is_some()
                && self.policy.accepts(step)
                && self.grad_norm.is_none() =>
            {
                self.grad_norm = Some((step, f64::from_bits(sum_squares_bits)));
                Ok(None)
            }
            other => Err(protocol(net, from, &other.describe())),
        }
    }
}

/// A between-layers hook for the master: handles every arrival with `side`, keeping the first
/// failure in `failure` for after the layer (a hook cannot return one).
fn servicer<'a>(
    side: &'a mut LossSide,
    job: &'a RingJob,
    net: &'a mut dyn RingNet,
    head: &'a mut Option<&mut MasterHead>,
    failure: &'a mut Option<Error>,
) -> impl FnMut() + 'a {
    move || {
        if failure.is_none()
            && let Err(e) = side.drain(job, net, head.as_deref_mut())
        {
            *failure = Some(e);
        }
    }
}

/// The last block of layers when the master holds it too (`--master-holds-head`): the final
/// activations and the logits then never leave the master either.
pub struct MasterHead {
    stage: Stage,
    optimizer: Optimizer,
}

impl MasterHead {
    /// Adds the head to the master's report: its layers live on the master too.
    fn count_in(&self, own: &mut ringtmp_metrics::NodeSummary) {
        let params = self.stage.params().len() as u64;
        own.params += params;
        own.param_bytes += params * 4;
        own.optimizer_bytes += self.optimizer.state_bytes() as u64;
    }
    /// The head `job` gives the master, if any, with its parameters (initial or resumed).
    fn load(job: &RingJob) -> Result<Option<Self>> {
        let Some(plan) = &job.head else {
            return Ok(None);
        };
        let layers = job.layers()?;
        let mut stage = Stage::new(
            &layers,
            plan.start..plan.end,
            job.spec.seed,
            job.spec.threads,
        );
        stage.set_input_grad(true);
        stage.set_deferred_weight_grads(job.defer_weight_grads && job.schedule != Schedule::Async);
        let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), stage.params().len());
        job.load(&mut stage, &mut optimizer)?;
        Ok(Some(Self { stage, optimizer }))
    }

    /// Whether the head's weight is tied to the token embedding of the master's stage 0.
    fn tied(&self) -> bool {
        self.stage.tied_ends().1
    }

    /// A tied head takes the table's values from stage 0 (after its step, and at the start).
    fn follow(&mut self, stage: &Stage) {
        if let (true, Some(table)) = (self.tied(), stage.tied_source()) {
            self.stage.set_tied_mirror(table);
        }
    }
}

/// What the master does when the last node's output for micro-batch `mb` arrives: the head's
/// forward (if it holds the head), the loss with the labels only it has, and the head's backward.
/// Returns the summed loss and the gradient to send back to the last node.
fn loss_site(
    job: &RingJob,
    head: Option<&mut MasterHead>,
    mb: u64,
    pass: &Pass,
    x: &[f32],
    labels: &[u32],
    scale: f32,
) -> Result<(f64, Vec<f32>)> {
    let mut dlogits = Vec::new();
    match head {
        None => {
            dlogits.resize(x.len(), 0.0);
            let out = job
                .spec
                .objective
                .score(x, labels, job.spec.classes, scale, &mut dlogits)?;
            Ok((out.loss_sum, dlogits))
        }
        Some(h) => {
            let rows = labels.len() / job.spec.positions();
            let logits = h.stage.forward(mb, x, rows, pass)?.to_vec();
            dlogits.resize(logits.len(), 0.0);
            let out =
                job.spec
                    .objective
                    .score(&logits, labels, job.spec.classes, scale, &mut dlogits)?;
            let dx = h
                .stage
                .backward(mb, &dlogits)?
                .map(<[f32]>::to_vec)
                .unwrap_or_default();
            Ok((out.loss_sum, dx))
        }
    }
}

/// Stage 0 on the master under every schedule, as one loop: forward micro-batches from the data,
/// backward the gradients rank 1 sends back, score what the last node returns ([`LossSide`]),
/// and step. The schedules differ only in what the loop may do next:
/// - `gpipe`/`1f1b`: stage 0's [`StageState`] decides; the micro-batches of mini-batch `step`
///   are `0..M`; one optimizer step after the last backward (a flush).
/// - `async`: micro-batch `k` of the run is micro-batch `k mod M` of mini-batch `k div M`; the
///   master keeps at most `in_flight` micro-batches between their forward and its own backward,
///   forwards whenever it may, steps after every backward (each micro-batch its own SGD step):
///   forward `k` comes after exactly `k − window + 1` backwards, the first stage of PipeDream's
///   static 1F1B, whatever the timing;
///   and lets the pipeline drain only before an evaluation or a checkpoint (`flush`), so every
///   stage is then at the same version.
struct MasterPipe {
    /// Micro-batches of the run forwarded by stage 0.
    forwarded: u64,
    /// Micro-batches of the run whose backward stage 0 has done.
    backwarded: u64,
    side: LossSide,
    x: Vec<f32>,
    y: Vec<u32>,
}

impl MasterPipe {
    fn new(job: &RingJob) -> Self {
        let first = job.first_step() * job.micro_batches as u64;
        Self {
            forwarded: first,
            backwarded: first,
            side: LossSide::new(LossPolicy::Async {
                micro_batches: job.micro_batches as u64,
            }),
            x: Vec::new(),
            y: Vec::new(),
        }
    }

    /// Runs until every micro-batch of mini-batch `step` is done on the master, starting no
    /// micro-batch of mini-batch `flush` or later (the next boundary where the pipeline must be
    /// empty). Returns the mini-batch's summed loss and its row count.
    fn run_minibatch(
        &mut self,
        step: u64,
        flush: u64,
        job: &RingJob,
        setup: &MasterSetup<'_>,
        batches: &mut BatchPlan,
        stage: &mut Stage,
        optimizer: &mut Optimizer,
        head: Option<&mut MasterHead>,
        clock: &mut NodeClock,
        net: &mut dyn RingNet,
    ) -> Result<(f64, usize)> {
        let n = job.partition.len() as u32;
        let m = job.micro_batches as u64;
        let mut head = head;
        // The flushed schedules: stage 0's decision rule, fresh for every mini-batch.
        let mut flushed = (job.schedule != Schedule::Async).then(|| {
            self.side = LossSide::new(LossPolicy::Flushed {
                step,
                rows_total: job.spec.batch_size * job.spec.positions(),
            });
            (self.forwarded, self.backwarded) = (step * m, step * m);
            StageState::new(job.schedule, 0, n as usize, job.micro_batches)
        });
        let window = job.async_window() as u64;
        let end = (step + 1) * m;
        let limit = if flushed.is_some() { end } else { flush * m };
        loop {
            let finished = match &flushed {
                Some(state) => state.done() && self.side.scored == m,
                None => self.backwarded >= end,
            };
            if finished {
                break;
            }
            // Arrived messages first whenever there is work to do (the loss is on every stage's
            // critical path), and between the layers of that work too.
            let may_forward = self.forwarded < limit
                && (flushed.is_some() || self.forwarded - self.backwarded < window);
            let grads = !self.side.grads.is_empty();
            let action = match &flushed {
                Some(state) => state.next(may_forward, grads),
                None if may_forward => Some(Action::Forward),
                None if grads => Some(Action::Backward),
                None => None,
            };
            let arrived = if action.is_some() {
                net.try_recv()?
            } else {
                None
            };
            let mut failure: Option<Error> = None;
            match if arrived.is_some() { None } else { action } {
                Some(Action::Forward) => {
                    self.forward_next(
                        job,
                        setup,
                        batches,
                        stage,
                        &mut head,
                        clock,
                        net,
                        flushed.is_some(),
                    )?;
                    if let Some(state) = flushed.as_mut() {
                        state.record(Action::Forward);
                    }
                }
                Some(Action::Backward) => {
                    let (id, dy) = self.side.grads.pop_front().expect("next() saw a gradient");
                    // A tied table (async) steps after the backward, with the head's share.
                    let tied = head.as_deref().is_some_and(MasterHead::tied);
                    let mut service = servicer(&mut self.side, job, net, &mut head, &mut failure);
                    if flushed.is_some() || tied {
                        clock.run(|| stage.backward_with(id, &dy, &mut service).map(|_| ()))?;
                    } else {
                        // Each async micro-batch is its own weight version and step, taken
                        // layer by layer in its backward.
                        let lr = job.lr_at(id / m);
                        clock.run(|| {
                            stage
                                .backward_and_step(id, &dy, optimizer, lr, &mut service)
                                .map(|_| ())
                        })?;
                    }
                    drop(service);
                    if let Some(e) = failure {
                        return Err(e);
                    }
                    if let (None, Some(h)) = (&flushed, head.as_deref_mut().filter(|h| h.tied())) {
                        let share = self.side.tied_grads.remove(&id).unwrap_or_default();
                        let lr = job.lr_at(id / m);
                        clock.run(|| {
                            stage.add_tied_grad(&share);
                            stage.step(optimizer, lr);
                        });
                        h.follow(stage);
                    }
                    self.backwarded += 1;
                    match flushed.as_mut() {
                        Some(state) => state.record(Action::Backward),
                        None => {
                            if (id + 1) % m == 0 {
                                job.after_minibatch(net, id / m, stage.params_mut())?;
                            }
                        }
                    }
                }
                None => {
                    let (from, message) =
                        arrived.map_or_else(|| clock.recv(net, job.recv_timeout()), Ok)?;
                    let side = &mut self.side;
                    clock.run(|| {
                        side.handle_and_send(job, net, head.as_deref_mut(), from, message)
                    })?;
                }
            }
        }
        if flushed.is_some() {
            Self::step_flushed(
                step,
                job,
                stage,
                optimizer,
                head,
                clock,
                net,
                &mut self.side,
            )?;
        }
        Ok((
            self.side.losses.remove(&step).unwrap_or(f64::NAN),
            job.spec.batch_size,
        ))
    }

    /// Starts the next micro-batch: its rows gathered, stage 0's forward (arrived messages
    /// served between layers), the activations sent on. `flushed`: the schedule flushes every
    /// mini-batch (micro-batch ids count within it).
    fn forward_next(
        &mut self,
        job: &RingJob,
        setup: &MasterSetup<'_>,
        batches: &mut BatchPlan,
        stage: &mut Stage,
        head: &mut Option<&mut MasterHead>,
        clock: &mut NodeClock,
        net: &mut dyn RingNet,
        flushed: bool,
    ) -> Result<()> {
        let n = job.partition.len() as u32;
        let succ = 1 % n;
        let m = job.micro_batches as u64;
        let mut failure: Option<Error> = None;
        let k = self.forwarded;
        let (s, part) = (k / m, (k % m) as usize);
        let indices = batches
            .batch(
                s / job.spec.steps_per_epoch,
                (s % job.spec.steps_per_epoch) as usize,
            )
            .to_vec();
        let ours = shard(&indices, job.ring, job.replicas.max(1))?;
        let rows = shard(ours, part, job.micro_batches)?.to_vec();
        setup.data.train.gather(&rows, &mut self.x, &mut self.y);
        let pass = Pass {
            train: true,
            seed: job.spec.seed,
            step: s,
            row_offset: micro_offset(job, part),
        };
        // Flushed: micro-batch `part` of this mini-batch; async: `k` of the run.
        let id = if flushed { part as u64 } else { k };
        let header_step = self.side.policy.header_step(id);
        self.side.forwarded(id, self.y.clone(), pass);
        let x = &self.x;
        let mut service = servicer(&mut self.side, job, net, head, &mut failure);
        let out = clock.run(|| {
            stage
                .forward_with(id, x, rows.len(), &pass, &mut service)
                .map(<[f32]>::to_vec)
        })?;
        drop(service);
        if let Some(e) = failure {
            return Err(e);
        }
        clock.peak_stash = clock.peak_stash.max(stage.stash_bytes());
        net.send(
            succ,
            tensor(
                TensorTag::Activation,
                header_step,
                id,
                rows.len(),
                &out,
                job.spec.wire_dtype,
            ),
        )?;
        self.forwarded += 1;
        Ok(())
    }

    /// The end of a flushed mini-batch: the tied table's and the replicas' gradients in,
    /// clipping, then the step of stage 0 and its head.
    fn step_flushed(
        step: u64,
        job: &RingJob,
        stage: &mut Stage,
        optimizer: &mut Optimizer,
        mut head: Option<&mut MasterHead>,
        clock: &mut NodeClock,
        net: &mut dyn RingNet,
        side: &mut LossSide,
    ) -> Result<()> {
        let lr = job.lr_at(step);
        if let Some(h) = head.as_deref_mut().filter(|h| h.tied()) {
            // The tied matrix's one update takes the head's gradient too.
            clock.run(|| stage.add_tied_grad(&h.stage.take_tied_grad()));
        }
        if job.averages_gradients() {
            net.average_with_replicas(step, stage.grads_mut())?;
        }
        if let Some(max_norm) = job.spec.clip_grad_norm {
            let early = side.grad_norm.take();
            clip_from_master(
                job,
                net,
                clock,
                (step, early),
                max_norm,
                stage,
                head.as_deref_mut(),
            )?;
        }
        clock.run(|| stage.step(optimizer, lr));
        if let Some(h) = head {
            clock.run(|| h.stage.step(&mut h.optimizer, lr));
            h.follow(stage);
        }
        job.after_minibatch(net, step, stage.params_mut())?;
        Ok(())
    }
}

/// Gradient clipping by the global norm, at the master (flushed schedules): the squared norms
/// of every other stage arrive summed from rank 1 (the last stage starts the sum, each stage
/// adds its own on the way back), the master adds its stage's and its head's, and sends the
/// factor around the ring, where every stage applies it before its step. The factor is
/// PyTorch's `clip_grad_norm_`'s of the whole model's gradient, the same on every stage.
/// `early` is the sum if it arrived during the step's last backward.
fn clip_from_master(
    job: &RingJob,
    net: &mut dyn RingNet,
    clock: &mut NodeClock,
    (step, early): (u64, Option<(u64, f64)>),
    max_norm: f32,
    stage: &mut Stage,
    head: Option<&mut MasterHead>,
) -> Result<()> {
    let succ = 1 % job.partition.len() as u32;
    let mut total = clock.run(|| stage.grad_norm_squared());
    let mut head = head;
    if let Some(h) = head.as_deref_mut() {
        total += clock.run(|| h.stage.grad_norm_squared());
    }
    let rest = match early {
        Some((s, sum)) if s == step => sum,
        Some((s, _)) => {
            return Err(protocol(
                net,
                succ,
                &format!("gradient norm of step {s} during step {step}"),
            ));
        }
        None => {
            let (from, message) = clock.recv(net, job.recv_timeout())?;
            match (from, Incoming::read(message, net, from)?) {
                (
                    from,
                    Incoming::Own(RingMessage::GradNorm {
                        step: s,
                        sum_squares_bits,
                    }),
                ) if from == succ && s == step => f64::from_bits(sum_squares_bits),
                (from, incoming) => return Err(protocol(net, from, &incoming.describe())),
            }
        }
    };
    let factor = ringtmp_contract::clipping::clip_factor((total + rest).sqrt(), max_norm);
    net.send(
        succ,
        RingMessage::ClipScale {
            step,
            factor_bits: factor.to_bits(),
        }
        .to_message(),
    )?;
    clock.run(|| stage.scale_grads(factor));
    if let Some(h) = head {
        clock.run(|| h.stage.scale_grads(factor));
    }
    Ok(())
}

/// Evaluation chunks on their way around the ring at once.
pub const EVAL_CHUNKS_IN_FLIGHT: usize = 8;

/// Sends the test set around the ring in chunks (at most 8 on their way at once); the master
/// scores the returning logits against its labels. Returns the test accuracy and mean loss.
fn evaluate(
    job: &RingJob,
    data: &Dataset,
    stage: &mut Stage,
    net: &mut dyn RingNet,
    step: u64,
    eval_bytes: &mut u64,
    mut head: Option<&mut MasterHead>,
) -> Result<ringtmp_contract::evaluation::Score> {
    let n = job.partition.len() as u32;
    let pred = n - 1;
    let split = &data.test;
    let per_chunk = match job.eval_rows {
        0 => ringtmp_contract::evaluation::eval_chunk(split, job.spec.classes),
        rows => rows,
    };
    let chunk = |i: usize| (i * per_chunk, ((i + 1) * per_chunk).min(split.len()));
    let (mut x, mut y, mut labels) = (Vec::new(), Vec::new(), Vec::<u32>::new());
    let mut unused = Vec::new();
    let (mut values, mut dlogits) = (Vec::new(), Vec::new());
    let (mut correct, mut loss_sum, mut abs_err_sum) = (0usize, 0.0f64, 0.0f64);
    let chunks = split.len().div_ceil(per_chunk);
    around_the_ring(
        net,
        n,
        (chunks, EVAL_CHUNKS_IN_FLIGHT),
        job.recv_timeout(),
        &mut |i| {
            let (start, end) = chunk(i);
            split.gather_range(start, end, &mut x, &mut y);
            let out = stage.infer(&x, end - start)?;
            // Evaluation travels in f32 whatever the wire type: accuracy is measured exactly.
            let message = tensor(
                TensorTag::Inference,
                step,
                i as u64,
                end - start,
                out,
                Dtype::F32,
            );
            *eval_bytes += ringtmp_wire::declared_len(&message) as u64;
            Ok(message)
        },
        &mut |net, message| match message {
            Message::Tensor(h, bytes)
                if h.tag == TensorTag::Inference && (h.micro_batch as usize) < chunks =>
            {
                let (start, end) = chunk(h.micro_batch as usize);
                split.gather_range(start, end, &mut unused, &mut labels);
                tensor_values(&bytes, h.dtype, &mut values);
                let logits = match head.as_deref_mut() {
                    Some(h) => h.stage.infer(&values, end - start)?,
                    None => values.as_slice(),
                };
                dlogits.resize(logits.len(), 0.0);
                let scored = job.spec.objective.score(
                    logits,
                    &labels,
                    job.spec.classes,
                    0.0,
                    &mut dlogits,
                )?;
                correct += scored.correct;
                loss_sum += scored.loss_sum;
                abs_err_sum += scored.abs_err_sum;
                Ok(())
            }
            _ => Err(protocol(net, pred, "message during evaluation")),
        },
    )?;
    let labels = split.len() * split.positions();
    Ok(ringtmp_contract::evaluation::Score::of(
        job.spec.objective,
        split,
        labels,
        (correct, loss_sum, abs_err_sum),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loss_policy_is_the_only_difference_between_the_schedules() {
        let flushed = LossPolicy::Flushed {
            step: 7,
            rows_total: 64,
        };
        assert!(flushed.accepts(7) && !flushed.accepts(8));
        assert_eq!((flushed.step_of(3), flushed.header_step(3)), (7, 7));
        // Every micro-batch's loss is part of the whole mini-batch's mean.
        assert_eq!(flushed.scale(16), 1.0 / 64.0);
        let asynchronous = LossPolicy::Async { micro_batches: 4 };
        assert!(asynchronous.accepts(0) && asynchronous.accepts(99));
        // Micro-batch 9 of the run is micro-batch 1 of mini-batch 2, its own SGD step.
        assert_eq!(
            (asynchronous.step_of(9), asynchronous.header_step(9)),
            (2, 9)
        );
        assert_eq!(asynchronous.scale(16), 1.0 / 16.0);
    }
}
