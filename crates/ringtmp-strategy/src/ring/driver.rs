//! The ring driver: runs one node's stage over the links, following the stage's schedule rule.
//!
//! Message flow (ring `0 → 1 → … → N−1 → 0`, node `s` holds stage `s`):
//! - `Activation` tensors go to the successor; the last stage's output (the logits) goes to the
//!   master, which computes the loss with labels nobody else ever sees.
//! - `Gradient` tensors go to the predecessor; the master sends the logits' gradient to node N−1.
//! - `Inference` tensors carry evaluation passes around the ring (nothing stashed).
//! - At the end, `Report` travels once around the ring, each node adding its measurements.
//!
//! Invariant (by construction): the master only ever sends `Activation`/`Inference` tensors
//! computed by stage 0 (which contains at least one layer with parameters, see the planner) and
//! `Gradient` tensors of the logits. No message type carries labels or raw inputs.
//!
//! Ordering: a node processes its messages in order and steps right after its last backward of a
//! mini-batch, before it can see anything of the next mini-batch (which only starts after the
//! master's own step, which waits for every gradient) — so every stage's forward of mini-batch
//! t+1 uses the weights after step t: exactly synchronous SGD.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ringtmp_data::{BatchPlan, Dataset, shard};
use ringtmp_metrics::{NodeSummary, Summary, resources};
use ringtmp_model::checkpoint;
use ringtmp_model::{Layer, Optimizer, Pass, Stage, loss};
use ringtmp_transport::{Clock, LinkStats, Transport, TransportError};
use ringtmp_wire::message::{tensor_bytes, tensor_values};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::partition::StagePlan;
use super::schedule::{Action, Schedule, StagePolicy, StageState};
use crate::error::{Error, Result};
use crate::local::Event;
use crate::recorder::RunRecorder;
use crate::spec::{ResumePoint, RunSpec};

/// Rows per evaluation chunk sent around the ring.
const EVAL_ROWS: usize = 250;

/// Everything every node of a ring run must agree on (rank 0 hands it out at rendezvous).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RingJob {
    /// What every strategy's job shares (model, data, optimizer, steps, checkpoints, …).
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Micro-batches per mini-batch.
    pub micro_batches: usize,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Stages, one per rank.
    pub partition: Vec<StagePlan>,
    /// The last block of layers, when the master holds it as well (U-shaped ring).
    #[serde(default)]
    pub head: Option<StagePlan>,
    /// Emulated relative speed per rank (1 = full speed).
    pub node_speeds: Vec<f64>,
    /// Synchronous schedules: compute each stage's linear weight gradients once per mini-batch
    /// (one GEMM over all its rows) instead of once per micro-batch; keeps those layers' inputs
    /// until the step.
    #[serde(default)]
    pub defer_weight_grads: bool,
    /// Async schedule: most micro-batches between their forward and the master's backward
    /// (0 = the number of nodes).
    #[serde(default)]
    pub in_flight: usize,
}

impl RingJob {
    /// The learning rate of mini-batch `step` (the schedule spans the whole run).
    fn lr_at(&self, step: u64) -> f32 {
        self.spec.lr_at(step)
    }

    fn layers(&self) -> Result<Vec<Layer>> {
        self.spec.layers()
    }

    fn stage(&self, rank: u32) -> Result<(Stage, StagePlan)> {
        let (mut stage, plan) = self.stage_unconfigured(rank)?;
        stage
            .set_deferred_weight_grads(self.defer_weight_grads && self.schedule != Schedule::Async);
        Ok((stage, plan))
    }

    fn stage_unconfigured(&self, rank: u32) -> Result<(Stage, StagePlan)> {
        let layers = self.layers()?;
        let plan = self
            .partition
            .get(rank as usize)
            .cloned()
            .ok_or_else(|| Error::Config(format!("no stage for rank {rank}")))?;
        let stage = Stage::new(
            &layers,
            plan.start..plan.end,
            self.spec.seed,
            self.spec.threads,
        );
        Ok((stage, plan))
    }

    fn recv_timeout(&self) -> Duration {
        self.spec.recv_timeout()
    }

    /// The step training starts at (0, or the resumed checkpoint's).
    pub fn first_step(&self) -> u64 {
        self.spec.first_step()
    }

    /// Loads this node's stage and optimizer state from the resume checkpoint, if any.
    fn load(&self, stage: &mut Stage, optimizer: &mut Optimizer) -> Result<()> {
        if let Some(ResumePoint { dir, .. }) = &self.spec.resume_from {
            let manifest = checkpoint::read_manifest(dir)?;
            checkpoint::read_stage(dir, &manifest, stage, optimizer)?;
        }
        Ok(())
    }

    fn checkpoint_due(&self, done: u64) -> bool {
        self.spec.checkpoint_every > 0
            && (done % self.spec.checkpoint_every == 0 || done == self.spec.total_steps)
    }

    fn checkpoint_dir(&self, step: u64) -> std::path::PathBuf {
        self.spec
            .out
            .join("checkpoints")
            .join(checkpoint::checkpoint_dir_name(step))
    }

    /// Writes this node's stage file for `step` and returns its entry as JSON.
    fn write_stage_file(
        &self,
        rank: u32,
        step: u64,
        stage: &Stage,
        optimizer: &Optimizer,
    ) -> Result<String> {
        self.write_stage_file_named(&format!("stage-{rank}"), step, stage, optimizer)
    }

    /// [`RingJob::write_stage_file`] under a given base name.
    fn write_stage_file_named(
        &self,
        name: &str,
        step: u64,
        stage: &Stage,
        optimizer: &Optimizer,
    ) -> Result<String> {
        let entry = checkpoint::write_stage(
            &self.checkpoint_dir(step),
            &format!("{name}.safetensors"),
            stage,
            optimizer,
        )?;
        serde_json::to_string(&entry).map_err(|e| Error::Config(e.to_string()))
    }

    /// Rank 0, after every node's file is written: the manifest (last, so a checkpoint is complete
    /// exactly when its manifest exists).
    fn write_manifest(&self, step: u64, files: &[String]) -> Result<std::path::PathBuf> {
        let files = files
            .iter()
            .map(|f| {
                serde_json::from_str(f).map_err(|e| {
                    Error::Config(format!("a node's checkpoint entry is invalid: {e}"))
                })
            })
            .collect::<Result<Vec<checkpoint::FileEntry>>>()?;
        let dir = self.checkpoint_dir(step);
        let manifest = checkpoint::Manifest {
            format: checkpoint::MANIFEST_FORMAT,
            strategy: "ring".into(),
            step,
            epoch: step / self.spec.steps_per_epoch,
            batch_in_epoch: step % self.spec.steps_per_epoch,
            dataset: self.spec.dataset.clone(),
            batch_size: self.spec.batch_size,
            seed: self.spec.seed,
            model: self.spec.model.clone(),
            partition: self
                .partition
                .iter()
                .chain(&self.head)
                .map(|p| (p.start, p.end))
                .collect(),
            optimizer: self.spec.optimizer.clone(),
            files,
        };
        checkpoint::write_manifest(&dir, &manifest)?;
        if let Some(keep) = self.spec.keep_checkpoints {
            checkpoint::retain_newest(&self.spec.out.join("checkpoints"), keep)?;
        }
        Ok(dir)
    }
}

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

/// Counters a node keeps about itself.
struct NodeClock {
    compute: f64,
    /// Wire bytes of evaluation frames this node sent.
    eval_bytes: u64,
    peak_stash: usize,
    speed: f64,
    /// The network's clock (wall or virtual): emulated slowness and compute time go through it.
    time: Arc<dyn Clock>,
}

impl NodeClock {
    fn new(net: &dyn Transport, speed: f64) -> Self {
        Self {
            compute: 0.0,
            eval_bytes: 0,
            peak_stash: 0,
            speed,
            time: net.clock(),
        }
    }

    /// Times `f` and accounts for it on the network's clock (which emulates a slower node).
    fn run<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let (t, wall) = (self.time.now(), Instant::now());
        let out = f();
        self.time.computed(wall.elapsed(), self.speed);
        self.compute += (self.time.now() - t).as_secs_f64();
        out
    }
}

fn header(tag: TensorTag, step: u64, micro_batch: u64, rows: usize, width: usize) -> TensorHeader {
    TensorHeader {
        run_id: 0,
        step,
        micro_batch,
        tag,
        dtype: Dtype::F32,
        shape: vec![rows as u32, width as u32],
    }
}

fn tensor(tag: TensorTag, step: u64, micro_batch: u64, rows: usize, values: &[f32]) -> Message {
    let width = values.len() / rows.max(1);
    Message::Tensor(
        header(tag, step, micro_batch, rows, width),
        tensor_bytes(values, Dtype::F32),
    )
}

fn protocol(net: &dyn Transport, from: u32, what: &str) -> Error {
    Error::Transport(TransportError::Io {
        context: format!("ring: unexpected {what} from {}", net.peer_name(from)),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not part of the ring protocol",
        ),
    })
}

/// Runs the master (rank 0): data, stage 0, loss, evaluation, outputs.
/// Returns the summary and the master's stages (their final parameters).
pub fn run_master(
    job: &RingJob,
    setup: &MasterSetup<'_>,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&Event),
) -> Result<MasterOutcome> {
    let time = net.clock();
    let wall = time.now();
    let n = job.partition.len() as u32;
    let pred = n - 1;
    let (mut stage, plan) = job.stage(0)?;
    let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), stage.params().len());
    stage.set_weight_stashing(job.schedule == Schedule::Async);
    job.load(&mut stage, &mut optimizer)?;
    let mut head = match &job.head {
        Some(plan) => {
            let layers = job.layers()?;
            let mut stage = Stage::new(
                &layers,
                plan.start..plan.end,
                job.spec.seed,
                job.spec.threads,
            );
            stage.set_input_grad(true);
            stage.set_deferred_weight_grads(
                job.defer_weight_grads && job.schedule != Schedule::Async,
            );
            let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), stage.params().len());
            job.load(&mut stage, &mut optimizer)?;
            Some(MasterHead { stage, optimizer })
        }
        None => None,
    };
    let mut batches = BatchPlan::new(setup.data.train.len(), job.spec.batch_size, job.spec.seed)?;
    let mut clock = NodeClock::new(net, job.node_speeds.first().copied().unwrap_or(1.0));
    let mut recorder = RunRecorder::open(
        &job.spec,
        "ring",
        json!({"schedule": job.schedule.name(), "nodes": n,
            "micro_batches": job.micro_batches, "partition": job.partition}),
    )?;
    let layers = job.layers()?;
    let count = |start: usize, end: usize| -> usize {
        layers[start..end].iter().map(|l| l.param_count()).sum()
    };
    on_event(&Event::Started {
        total_steps: job.spec.total_steps,
        first_step: job.first_step(),
        params: count(0, layers.len()),
        // The master's share includes the head it holds (U-shape).
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
    });

    let timeout = job.recv_timeout();
    let mut pipe = MasterPipe::new(job);
    let (mut train_seconds, mut samples) = (0.0f64, 0u64);
    for step in job.first_step()..job.spec.total_steps {
        let t_step = time.now();
        let epoch = step / job.spec.steps_per_epoch;
        let lr = job.lr_at(step);
        let (step_loss, rows_total) = pipe.run_minibatch(
            step,
            next_flush(job, step),
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
        let mean_loss = step_loss / rows_total as f64;
        if !mean_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: mean_loss,
            });
        }
        let done = step + 1;
        recorder.step(done, mean_loss, lr, train_seconds)?;
        on_event(&Event::Step {
            step: done,
            epoch,
            loss: mean_loss,
            samples_per_second: samples as f64 / train_seconds.max(1e-9),
        });
        if job.spec.eval_due(done) {
            let (accuracy, test_loss) = evaluate(
                job,
                setup.data,
                &mut stage,
                net,
                done,
                &mut clock.eval_bytes,
                head.as_mut(),
            )?;
            recorder.eval(
                done,
                accuracy,
                Some(test_loss),
                train_seconds,
                (time.now() - wall).as_secs_f64(),
            )?;
            on_event(&Event::Eval {
                step: done,
                epoch,
                accuracy,
                loss: test_loss,
            });
        }
        if job.checkpoint_due(done) {
            // Around the ring: each node writes its stage file and appends its entry; the
            // manifest comes last, so an interrupted checkpoint leaves the previous one intact.
            let own = job.write_stage_file(0, done, &stage, &optimizer)?;
            let token = Control::Checkpoint {
                step: done,
                files: vec![own],
            };
            let mut files = match around_the_ring(net, n, token, timeout)? {
                Control::Checkpoint { step: s, files }
                    if s == done && files.len() == n as usize =>
                {
                    files
                }
                _ => {
                    return Err(protocol(
                        net,
                        pred,
                        "message instead of the checkpoint entries",
                    ));
                }
            };
            if let Some(h) = &head {
                files.push(job.write_stage_file_named(
                    "stage-head",
                    done,
                    &h.stage,
                    &h.optimizer,
                )?);
            }
            let dir = job.write_manifest(done, &files)?;
            recorder.checkpoint(done, &dir)?;
            on_event(&Event::Checkpoint {
                step: done,
                path: dir,
            });
        }
    }
    // Collect every node's measurements around the ring.
    let mut own = node_summary(
        0,
        "master",
        &stage,
        &optimizer,
        &plan,
        &clock,
        train_seconds,
        &net.stats(),
    );
    if let Some(h) = &head {
        // The head's layers live on the master too.
        let params = h.stage.params().len() as u64;
        own.params += params;
        own.param_bytes += params * 4;
        own.optimizer_bytes += h.optimizer.state_bytes() as u64;
    }
    let mut per_node = vec![own];
    match around_the_ring(net, n, Control::Report { nodes: Vec::new() }, timeout)? {
        Control::Report { nodes } => {
            for doc in nodes {
                per_node
                    .push(serde_json::from_str(&doc).map_err(|e| {
                        Error::Config(format!("a node's report is not valid: {e}"))
                    })?);
            }
        }
        _ => return Err(protocol(net, pred, "message instead of the final report")),
    }
    let total_bytes_sent: u64 = per_node.iter().map(|p| p.bytes_sent).sum();
    let per_node_eval: u64 = per_node.iter().map(|p| p.eval_bytes_sent).sum();
    let model_params = job.layers()?.iter().map(|l| l.param_count() as u64).sum();
    let (m, nn) = (job.micro_batches as f64, f64::from(n));
    let summary = Summary {
        schedule: Some(job.schedule.name().into()),
        model_params,
        micro_batches: job.micro_batches as u32,
        steps: job.spec.total_steps,
        samples,
        wall_seconds: (time.now() - wall).as_secs_f64(),
        train_seconds,
        samples_per_second: samples as f64 / train_seconds.max(1e-9),
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
    };
    recorder.finish(&summary)?;
    Ok(MasterOutcome {
        summary,
        stage,
        head: head.map(|h| h.stage),
    })
}

/// Sends a token (a checkpoint's entries, the final report) around the ring from the master and
/// returns it as it comes back, every node having added its part ([`RingNode::serve`] is the
/// other half): the one mechanism for what travels once around the ring.
fn around_the_ring(
    net: &mut dyn Transport,
    n: u32,
    token: Control,
    timeout: Duration,
) -> Result<Control> {
    let (succ, pred) = (1 % n, n - 1);
    net.send(succ, Message::Control(token))?;
    match net.recv_from(pred, timeout)? {
        Message::Control(c @ (Control::Checkpoint { .. } | Control::Report { .. })) => Ok(c),
        _ => Err(protocol(
            net,
            pred,
            "message instead of the token going round",
        )),
    }
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
        net: &mut dyn Transport,
        mut head: Option<&mut MasterHead>,
    ) -> Result<()> {
        while let Some((from, message)) = net.try_recv()? {
            self.handle(job, net, head.as_deref_mut(), from, message)?;
        }
        Ok(())
    }

    /// One arrival: the last node's output (→ head, loss, gradient back) or a gradient for
    /// stage 0 (→ queued). Anything else is the sender's protocol error.
    fn handle(
        &mut self,
        job: &RingJob,
        net: &mut dyn Transport,
        head: Option<&mut MasterHead>,
        from: u32,
        message: Message,
    ) -> Result<()> {
        let n = job.partition.len() as u32;
        let (succ, pred) = (1 % n, n - 1);
        match message {
            Message::Tensor(h, bytes)
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
                    // Each async micro-batch is its own step, on the head too.
                    h.stage.step(&mut h.optimizer, job.lr_at(step));
                }
                *self.losses.entry(step).or_default() += loss_sum;
                self.scored += 1;
                net.send(
                    pred,
                    tensor(
                        TensorTag::Gradient,
                        self.policy.header_step(id),
                        id,
                        labels.len(),
                        &grad,
                    ),
                )?;
                Ok(())
            }
            Message::Tensor(h, bytes)
                if from == succ && h.tag == TensorTag::Gradient && self.policy.accepts(h.step) =>
            {
                let mut dy = Vec::new();
                tensor_values(&bytes, h.dtype, &mut dy);
                self.grads.push_back((h.micro_batch, dy));
                Ok(())
            }
            _ => Err(protocol(net, from, "message")),
        }
    }
}

/// A between-layers hook for the master: handles every arrival with `side`, keeping the first
/// failure in `failure` for after the layer (a hook cannot return one).
fn servicer<'a>(
    side: &'a mut LossSide,
    job: &'a RingJob,
    net: &'a mut dyn Transport,
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

/// What the master does when the last node's output for micro-batch `mb` arrives: the head's
/// forward (if it holds the head), the loss with the labels only it has, and the head's backward.
/// Returns the summed loss and the gradient to send back to the last node.
#[allow(clippy::too_many_arguments)]
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
            let out =
                loss::softmax_cross_entropy(x, labels, job.spec.classes, scale, &mut dlogits)?;
            Ok((out.loss_sum, dlogits))
        }
        Some(h) => {
            let logits = h.stage.forward(mb, x, labels.len(), pass)?.to_vec();
            dlogits.resize(logits.len(), 0.0);
            let out = loss::softmax_cross_entropy(
                &logits,
                labels,
                job.spec.classes,
                scale,
                &mut dlogits,
            )?;
            let dx = h
                .stage
                .backward(mb, &dlogits)?
                .map(<[f32]>::to_vec)
                .unwrap_or_default();
            Ok((out.loss_sum, dx))
        }
    }
}

/// Whether the master evaluates after `done` steps: every epoch end, the last step, and every
/// `eval_every` steps.
/// The first mini-batch boundary at or after mini-batch `step` where the async pipeline must be
/// empty (an evaluation or a checkpoint follows it): micro-batches beyond it must not start
/// before it, or they would still be in the ring when the evaluation's chunks go round.
fn next_flush(job: &RingJob, step: u64) -> u64 {
    (step + 1..=job.spec.total_steps)
        .find(|&done| job.checkpoint_due(done) || job.spec.eval_due(done))
        .unwrap_or(job.spec.total_steps)
}

/// Stage 0 on the master under every schedule, as one loop: forward micro-batches from the data,
/// backward the gradients rank 1 sends back, score what the last node returns ([`LossSide`]),
/// and step. The schedules differ only in what the loop may do next:
/// - `gpipe`/`1f1b`: stage 0's [`StageState`] decides; the micro-batches of mini-batch `step`
///   are `0..M`; one optimizer step after the last backward (a flush).
/// - `async`: micro-batch `k` of the run is micro-batch `k mod M` of mini-batch `k div M`; the
///   master keeps at most `in_flight` micro-batches between their forward and its own backward,
///   forwards whenever it may, steps after every backward (each micro-batch its own SGD step),
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
    #[allow(clippy::too_many_arguments)]
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
        net: &mut dyn Transport,
    ) -> Result<(f64, usize)> {
        let n = job.partition.len() as u32;
        let succ = 1 % n;
        let m = job.micro_batches as u64;
        let mut head = head;
        // The flushed schedules: stage 0's decision rule, fresh for every mini-batch.
        let mut flushed = (job.schedule != Schedule::Async).then(|| {
            self.side = LossSide::new(LossPolicy::Flushed {
                step,
                rows_total: job.spec.batch_size,
            });
            (self.forwarded, self.backwarded) = (step * m, step * m);
            StageState::new(job.schedule, 0, n as usize, job.micro_batches)
        });
        let window = match job.in_flight {
            0 => u64::from(n),
            w => w as u64,
        };
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
                    let k = self.forwarded;
                    let (s, part) = (k / m, (k % m) as usize);
                    let indices = batches
                        .batch(
                            s / job.spec.steps_per_epoch,
                            (s % job.spec.steps_per_epoch) as usize,
                        )
                        .to_vec();
                    let rows = shard(&indices, part, job.micro_batches)?.to_vec();
                    setup.data.train.gather(&rows, &mut self.x, &mut self.y);
                    let pass = Pass {
                        train: true,
                        seed: job.spec.seed,
                        step: s,
                        row_offset: micro_offset(job, part),
                    };
                    // Flushed: micro-batch `part` of this mini-batch; async: `k` of the run.
                    let id = if flushed.is_some() { part as u64 } else { k };
                    let header_step = self.side.policy.header_step(id);
                    self.side.forwarded(id, self.y.clone(), pass);
                    let x = &self.x;
                    let mut service = servicer(&mut self.side, job, net, &mut head, &mut failure);
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
                        tensor(TensorTag::Activation, header_step, id, rows.len(), &out),
                    )?;
                    self.forwarded += 1;
                    if let Some(state) = flushed.as_mut() {
                        state.record(Action::Forward);
                    }
                }
                Some(Action::Backward) => {
                    let (id, dy) = self.side.grads.pop_front().expect("next() saw a gradient");
                    let mut service = servicer(&mut self.side, job, net, &mut head, &mut failure);
                    clock.run(|| stage.backward_with(id, &dy, &mut service).map(|_| ()))?;
                    drop(service);
                    if let Some(e) = failure {
                        return Err(e);
                    }
                    self.backwarded += 1;
                    match flushed.as_mut() {
                        Some(state) => state.record(Action::Backward),
                        None => {
                            // Each async micro-batch is its own weight version and step.
                            let lr = job.lr_at(id / m);
                            clock.run(|| stage.step(optimizer, lr));
                        }
                    }
                }
                None => {
                    let (from, message) =
                        arrived.map_or_else(|| net.recv(job.recv_timeout()), Ok)?;
                    let side = &mut self.side;
                    clock.run(|| side.handle(job, net, head.as_deref_mut(), from, message))?;
                }
            }
        }
        if flushed.is_some() {
            let lr = job.lr_at(step);
            clock.run(|| stage.step(optimizer, lr));
            if let Some(h) = head {
                clock.run(|| h.stage.step(&mut h.optimizer, lr));
            }
        }
        Ok((
            self.side.losses.remove(&step).unwrap_or(f64::NAN),
            job.spec.batch_size,
        ))
    }
}

/// Sends the test set around the ring in chunks; the master scores the returning logits against
/// its labels. Returns the test accuracy and mean loss.
fn evaluate(
    job: &RingJob,
    data: &Dataset,
    stage: &mut Stage,
    net: &mut dyn Transport,
    step: u64,
    eval_bytes: &mut u64,
    mut head: Option<&mut MasterHead>,
) -> Result<(f64, f64)> {
    let n = job.partition.len() as u32;
    let (succ, pred) = (1 % n, n - 1);
    let split = &data.test;
    let mut dlogits = Vec::new();
    let mut loss_sum = 0.0f64;
    let chunks = split.len().div_ceil(EVAL_ROWS);
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut labels: Vec<Vec<u32>> = Vec::with_capacity(chunks);
    let mut values = Vec::new();
    let (mut sent, mut received, mut correct) = (0usize, 0usize, 0usize);
    // Keep a bounded number of chunks in the ring at once.
    while received < chunks {
        if sent < chunks && sent - received < 8 {
            let (start, end) = (sent * EVAL_ROWS, ((sent + 1) * EVAL_ROWS).min(split.len()));
            split.gather_range(start, end, &mut x, &mut y);
            labels.push(y.clone());
            let out = stage.infer(&x, end - start)?.to_vec();
            let message = tensor(TensorTag::Inference, step, sent as u64, end - start, &out);
            *eval_bytes += ringtmp_wire::encoded_len(&message) as u64;
            net.send(succ, message)?;
            sent += 1;
            continue;
        }
        match net.recv_from(pred, job.recv_timeout())? {
            Message::Tensor(h, bytes) if h.tag == TensorTag::Inference => {
                tensor_values(&bytes, h.dtype, &mut values);
                let l = labels
                    .get(h.micro_batch as usize)
                    .ok_or_else(|| protocol(net, pred, "evaluation chunk"))?;
                let logits = match head.as_deref_mut() {
                    Some(h) => h.stage.infer(&values, l.len())?,
                    None => values.as_slice(),
                };
                dlogits.resize(logits.len(), 0.0);
                let scored =
                    loss::softmax_cross_entropy(logits, l, job.spec.classes, 0.0, &mut dlogits)?;
                correct += scored.correct;
                loss_sum += scored.loss_sum;
                received += 1;
            }
            _ => return Err(protocol(net, pred, "message during evaluation")),
        }
    }
    let rows = split.len().max(1) as f64;
    Ok((correct as f64 / rows, loss_sum / rows))
}

/// Runs a non-master node: its stage, driven by what arrives, until the final report passes.
/// One loop for every schedule: the [`StagePolicy`] decides what to do next and which tensors
/// belong to the work in progress; this loop moves the messages and runs the compute. Arrived
/// messages are taken first whenever there is work to do, so the policy decides on everything
/// that is there. Returns the stage (its final parameters).
pub fn run_worker(job: &RingJob, net: &mut dyn Transport) -> Result<Stage> {
    let mut node = RingNode::new(job, net, job.schedule == Schedule::Async)?;
    let (rank, n) = (node.rank as usize, job.partition.len());
    let timeout = job.recv_timeout();
    let mut policy = StagePolicy::new(job.schedule, rank, n, job.micro_batches, job.first_step());
    let mut inputs: VecDeque<(u64, usize, Vec<f32>)> = VecDeque::new();
    let mut grads: VecDeque<(u64, Vec<f32>)> = VecDeque::new();
    loop {
        let action = policy.next(!inputs.is_empty(), !grads.is_empty());
        let arrived = if action.is_some() {
            net.try_recv()?
        } else {
            None
        };
        match if arrived.is_some() { None } else { action } {
            Some(Action::Forward) => {
                let (id, rows, x) = inputs.pop_front().expect("next() saw an input");
                let at = policy.forward_at(id);
                node.forward(
                    job,
                    net,
                    (at.header_step, at.id),
                    at.step,
                    at.micro,
                    rows,
                    &x,
                )?;
                policy.record(Action::Forward, id);
            }
            Some(Action::Backward) => {
                let (id, dy) = grads.pop_front().expect("next() saw a gradient");
                node.backward(net, id, policy.backward_step(id), &dy)?;
                if let Some(step) = policy.record(Action::Backward, id) {
                    node.step(job, step);
                }
            }
            None => match arrived.map_or_else(|| net.recv(timeout), Ok)? {
                (from, Message::Tensor(h, bytes))
                    if from == node.pred
                        && h.tag == TensorTag::Activation
                        && policy.accepts(h.step) =>
                {
                    let rows = h.shape.first().copied().unwrap_or(0) as usize;
                    inputs.push_back((h.micro_batch, rows, values(&bytes, h.dtype)));
                }
                (from, Message::Tensor(h, bytes))
                    if from == node.succ
                        && h.tag == TensorTag::Gradient
                        && policy.accepts(h.step) =>
                {
                    grads.push_back((h.micro_batch, values(&bytes, h.dtype)));
                }
                (
                    from,
                    message @ (Message::Tensor(
                        TensorHeader {
                            tag: TensorTag::Inference,
                            ..
                        },
                        _,
                    )
                    | Message::Control(
                        Control::Checkpoint { .. } | Control::Report { .. },
                    )),
                ) => {
                    if node.serve(job, net, from, message)? {
                        return Ok(node.stage);
                    }
                }
                (from, Message::Tensor(h, _)) => {
                    return Err(protocol(
                        net,
                        from,
                        &format!("{:?} tensor for step {}", h.tag, h.step),
                    ));
                }
                (from, _) => return Err(protocol(net, from, "message")),
            },
        }
    }
}

/// A payload's values as f32.
fn values(bytes: &[u8], dtype: ringtmp_wire::Dtype) -> Vec<f32> {
    let mut out = Vec::new();
    tensor_values(bytes, dtype, &mut out);
    out
}

/// A non-master node, as both of its loops (flushed schedules and async) use it: its stage and
/// optimizer, neighbours and clocks; the forward, backward and step of its schedule; and what it
/// does besides (forward evaluation passes, write its checkpoint file, add its report at the end).
struct RingNode {
    rank: u32,
    succ: u32,
    pred: u32,
    stage: Stage,
    optimizer: Optimizer,
    plan: StagePlan,
    clock: NodeClock,
    started: Duration,
}

impl RingNode {
    /// This node's stage (loaded from the job's checkpoint when resuming), its neighbours and
    /// clocks; `stashing` keeps a weight version per micro-batch in flight (async).
    fn new(job: &RingJob, net: &dyn Transport, stashing: bool) -> Result<Self> {
        let rank = net.rank();
        let n = job.partition.len() as u32;
        let (mut stage, plan) = job.stage(rank)?;
        stage.set_input_grad(true);
        stage.set_weight_stashing(stashing);
        let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), stage.params().len());
        job.load(&mut stage, &mut optimizer)?;
        Ok(Self {
            rank,
            succ: (rank + 1) % n,
            pred: (rank + n - 1) % n,
            stage,
            optimizer,
            plan,
            clock: NodeClock::new(
                net,
                job.node_speeds.get(rank as usize).copied().unwrap_or(1.0),
            ),
            started: net.clock().now(),
        })
    }

    /// Forward of stage micro-batch `header.1` (`micro`-th of mini-batch `step`, which seeds its
    /// dropout and places its rows) and sends the activation on with `header` as (step, micro-batch).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        job: &RingJob,
        net: &mut dyn Transport,
        header: (u64, u64),
        step: u64,
        micro: usize,
        rows: usize,
        x: &[f32],
    ) -> Result<()> {
        let (header_step, id) = header;
        let pass = Pass {
            train: true,
            seed: job.spec.seed,
            step,
            row_offset: micro_offset(job, micro),
        };
        let stage = &mut self.stage;
        let out = self
            .clock
            .run(|| stage.forward(id, x, rows, &pass).map(<[f32]>::to_vec))?;
        self.clock.peak_stash = self.clock.peak_stash.max(self.stage.stash_bytes());
        net.send(
            self.succ,
            tensor(TensorTag::Activation, header_step, id, rows, &out),
        )?;
        Ok(())
    }

    /// Backward of stage micro-batch `id`; sends the input gradient back tagged
    /// (`header_step`, `id`).
    fn backward(
        &mut self,
        net: &mut dyn Transport,
        id: u64,
        header_step: u64,
        dy: &[f32],
    ) -> Result<()> {
        let stage = &mut self.stage;
        let dx = self
            .clock
            .run(|| stage.backward(id, dy).map(|d| d.map(<[f32]>::to_vec)))?;
        let dx = dx.expect("input gradients are on for non-master stages");
        let rows = dy.len() / self.stage.output_len().max(1);
        net.send(
            self.pred,
            tensor(TensorTag::Gradient, header_step, id, rows, &dx),
        )?;
        Ok(())
    }

    /// The optimizer step of mini-batch `step`.
    fn step(&mut self, job: &RingJob, step: u64) {
        let lr = job.lr_at(step);
        let (stage, optimizer) = (&mut self.stage, &mut self.optimizer);
        self.clock.run(|| stage.step(optimizer, lr));
    }

    /// Handles an evaluation chunk, a checkpoint or the final report from the predecessor;
    /// returns `true` when the run is over for this node. Anything else is a protocol error.
    fn serve(
        &mut self,
        job: &RingJob,
        net: &mut dyn Transport,
        from: u32,
        message: Message,
    ) -> Result<bool> {
        if from != self.pred {
            return Err(protocol(net, from, "message"));
        }
        match message {
            Message::Tensor(h, bytes) if h.tag == TensorTag::Inference => {
                let rows = h.shape.first().copied().unwrap_or(0) as usize;
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                let out = self.stage.infer(&values, rows)?.to_vec();
                let message = tensor(TensorTag::Inference, h.step, h.micro_batch, rows, &out);
                self.clock.eval_bytes += ringtmp_wire::encoded_len(&message) as u64;
                net.send(self.succ, message)?;
                Ok(false)
            }
            Message::Control(Control::Checkpoint { step, mut files }) => {
                files.push(job.write_stage_file(self.rank, step, &self.stage, &self.optimizer)?);
                net.send(
                    self.succ,
                    Message::Control(Control::Checkpoint { step, files }),
                )?;
                Ok(false)
            }
            Message::Control(Control::Report { mut nodes }) => {
                let stats = net.stats();
                let own = node_summary(
                    self.rank,
                    "stage",
                    &self.stage,
                    &self.optimizer,
                    &self.plan,
                    &self.clock,
                    (self.clock.time.now() - self.started).as_secs_f64(),
                    &stats,
                );
                nodes.push(serde_json::to_string(&own).map_err(|e| Error::Config(e.to_string()))?);
                net.send(self.succ, Message::Control(Control::Report { nodes }))?;
                Ok(true)
            }
            Message::Tensor(h, _) => Err(protocol(
                net,
                from,
                &format!("{:?} tensor for step {}", h.tag, h.step),
            )),
            Message::Control(_) => Err(protocol(net, from, "control message")),
        }
    }
}

/// Row offset of micro-batch `mb` within its mini-batch (the same split as the master's).
fn micro_offset(job: &RingJob, mb: usize) -> usize {
    let (base, extra) = (
        job.spec.batch_size / job.micro_batches,
        job.spec.batch_size % job.micro_batches,
    );
    mb * base + mb.min(extra)
}

#[allow(clippy::too_many_arguments)]
fn node_summary(
    rank: u32,
    role: &str,
    stage: &Stage,
    optimizer: &Optimizer,
    plan: &StagePlan,
    clock: &NodeClock,
    train_seconds: f64,
    links: &[LinkStats],
) -> NodeSummary {
    let params = stage.params().len() as u64;
    NodeSummary {
        rank,
        role: role.into(),
        params,
        param_bytes: params * 4,
        optimizer_bytes: optimizer.state_bytes() as u64,
        peak_rss_bytes: resources::peak_rss_bytes().unwrap_or(0),
        bytes_sent: links.iter().map(|l| l.bytes_sent).sum(),
        eval_bytes_sent: clock.eval_bytes,
        bytes_received: links.iter().map(|l| l.bytes_received).sum(),
        messages_sent: links.iter().map(|l| l.messages_sent).sum(),
        compute_seconds: clock.compute,
        idle_seconds: (train_seconds - clock.compute).max(0.0),
        cpu_seconds: resources::cpu_seconds(),
        bubble_fraction: ((train_seconds - clock.compute) / train_seconds.max(1e-9))
            .clamp(0.0, 1.0),
        peak_stash_bytes: clock.peak_stash as u64,
        layers: Some((plan.start, plan.end)),
        links: links
            .iter()
            .map(|l| (l.peer, l.bytes_sent, l.bytes_received))
            .collect(),
        ..Default::default()
    }
}
