//! The ring's job and what its master and stage nodes share (their clocks, tensor messages,
//! reports); the master's loop is in `master`, every other node's in `worker`.
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

use std::sync::Arc;
use std::time::{Duration, Instant};

use ringtmp_metrics::NodeSummary;
use ringtmp_model::checkpoint;
use ringtmp_model::{Layer, Optimizer, Stage};
use ringtmp_transport::{Clock, LinkStats, Transport, TransportError};
use ringtmp_wire::message::{tensor_bytes, tensor_values};
use ringtmp_wire::{Dtype, Message, TensorHeader, TensorTag};
use serde::{Deserialize, Serialize};

use crate::net::RingNet;
use crate::plan::partition::{CutInside, StagePlan};
use crate::run::schedule::Schedule;
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::RunSpec;

pub use crate::run::master::{MasterHead, MasterOutcome, MasterSetup, run_master, run_master_with};
pub use crate::run::worker::{run_worker, run_worker_with};

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
    /// Stages, one per rank, over the layers of [`RingJob::layers`] (the model's, with the
    /// `cuts_inside` made).
    pub partition: Vec<StagePlan>,
    /// Linear layers cut by their output features between two stages (the planner's finer
    /// cuts, docs/decisions/edge-emulation.md), in the model's layer positions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cuts_inside: Vec<CutInside>,
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
    /// Nodes of the run the plan leaves out (ranks after the ring's): they join the rendezvous
    /// and leave.
    #[serde(default)]
    pub idle_nodes: u32,
    /// Stage replicas: mini-batches between replication rounds (0 = no replicas).
    #[serde(default)]
    pub replica_every: u64,
    /// Rings of rings (`--replicas R`): rings training side by side, each on its share of every
    /// global batch of R × `batch_size`, corresponding stages averaging their gradients.
    #[serde(default = "one")]
    pub replicas: usize,
    /// Rings of rings: 0 = the copies of a stage average their gradients before every step;
    /// K = each ring steps on its own and the copies average their parameters every K
    /// mini-batches and after the last.
    #[serde(default)]
    pub average_every: u64,
    /// Rings of rings under `--replica-sync adpsgd:K`: the copies of a stage gossip their
    /// parameters asynchronously (an active copy starts an exchange after every K-th
    /// mini-batch, a passive one answers after every mini-batch) and average once at the end;
    /// 0 = no gossip.
    #[serde(default)]
    pub gossip_every: u64,
    /// Rings of rings under `--replica-sync diloco:H`: every `average_every` mini-batches the
    /// copies of a stage average their pseudo-gradients (the outer parameters minus their
    /// own) and take this outer optimizer's step together, stage by stage.
    #[serde(default)]
    pub outer_sync: Option<ringtmp_collective::outer::OuterConfig>,
    /// Windows or images per evaluation pass around the ring, chosen by the planner so that a
    /// node's evaluation fits its memory (0: [`ringtmp_contract::evaluation::eval_chunk`]'s).
    #[serde(default)]
    pub eval_rows: usize,
    /// Which of those rings this node's is (set by each node at run time from its rank).
    #[serde(skip)]
    pub ring: usize,
}

impl RingJob {
    /// Whether the copies of a stage average their gradients before the step of every
    /// mini-batch (rings of rings under `--replica-sync gradients`).
    pub fn averages_gradients(&self) -> bool {
        self.replicas > 1 && self.average_every == 0 && self.gossip_every == 0
    }

    /// Whether the copies of a stage gossip at the end of every mini-batch (rings of rings
    /// under `--replica-sync adpsgd`).
    pub fn gossips_params(&self) -> bool {
        self.replicas > 1 && self.gossip_every > 0
    }

    /// Rings of rings: what the copies of a stage do once mini-batch `step` is complete
    /// (average their parameters under `every:K`, gossip under `adpsgd`).
    pub(crate) fn after_minibatch(
        &self,
        net: &mut dyn RingNet,
        step: u64,
        params: &mut [f32],
    ) -> std::result::Result<(), TransportError> {
        if self.averages_params_after(step) {
            net.average_with_replicas(step, params)?;
        } else if self.gossips_params() {
            net.gossip_with_replicas(step, params, step + 1 == self.spec.total_steps)?;
        }
        Ok(())
    }

    /// Whether the copies of a stage average their parameters after mini-batch `step` is
    /// complete (rings of rings under `--replica-sync every:K`: every K-th and the last).
    pub fn averages_params_after(&self, step: u64) -> bool {
        self.replicas > 1
            && self.average_every > 0
            && ((step + 1).is_multiple_of(self.average_every) || step + 1 == self.spec.total_steps)
    }
}

fn one() -> usize {
    1
}

impl RingJob {
    /// The learning rate of mini-batch `step` (the schedule spans the whole run).
    pub(crate) fn lr_at(&self, step: u64) -> f32 {
        self.spec.lr_at(step)
    }

    /// The layers the stages hold: the model's, with every cut inside a layer made (a head
    /// and a tail in the layer's place).
    pub fn layers(&self) -> Result<Vec<Layer>> {
        Self::cut_layers(self.spec.layers()?, &self.cuts_inside)
            .map_err(|e| Error::Config(format!("invalid job: {e}")))
    }

    /// `layers` (a model's) with every cut of `cuts` made: each cut layer replaced by its head
    /// and tail.
    pub fn cut_layers(
        mut layers: Vec<Layer>,
        cuts: &[CutInside],
    ) -> ringtmp_model::Result<Vec<Layer>> {
        let mut cuts = cuts.to_vec();
        // From the last, so that each cut's position in the model is still its position here.
        cuts.sort_by_key(|c| std::cmp::Reverse(c.layer));
        for cut in cuts {
            layers = ringtmp_model::layers::cut_linear(&layers, cut.layer, cut.split)?;
        }
        Ok(layers)
    }

    /// A stage's layers `[start, end)` in the model's indices (a cut layer's head and tail
    /// share one): what a checkpoint's manifest records.
    pub fn model_layers(layers: &[Layer], plan: &StagePlan) -> (usize, usize) {
        match (layers.get(plan.start), layers.get(plan.end.wrapping_sub(1))) {
            (Some(first), Some(last)) => (first.index, last.index + 1),
            _ => (plan.start, plan.end),
        }
    }

    pub(crate) fn stage(&self, rank: u32) -> Result<(Stage, StagePlan)> {
        let (mut stage, plan) = self.stage_unconfigured(rank)?;
        stage
            .set_deferred_weight_grads(self.defer_weight_grads && self.schedule != Schedule::Async);
        // Per-layer times for the summary: two clock reads per layer and pass.
        stage.set_profiling(true);
        Ok((stage, plan))
    }

    pub(crate) fn stage_unconfigured(&self, rank: u32) -> Result<(Stage, StagePlan)> {
        let layers = self.layers()?;
        let plan = self
            .partition
            .get(rank as usize)
            .cloned()
            .ok_or_else(|| Error::Config(format!("no stage for rank {rank}")))?;
        let stage = self.spec.initial_stage(
            &layers,
            plan.start..plan.end,
            self.spec.threads,
            self.spec.resume_from.is_some(),
        )?;
        Ok((stage, plan))
    }

    pub(crate) fn recv_timeout(&self) -> Duration {
        self.spec.recv_timeout()
    }

    /// The step training starts at (0, or the resumed checkpoint's).
    pub fn first_step(&self) -> u64 {
        self.spec.first_step()
    }

    /// Loads this node's stage and optimizer state from the resume checkpoint, if any.
    pub(crate) fn load(&self, stage: &mut Stage, optimizer: &mut Optimizer) -> Result<()> {
        self.spec.restore(stage, optimizer)
    }

    /// Whether a replication round follows mini-batch `done` (not after the last one).
    pub(crate) fn replica_due(&self, done: u64) -> bool {
        self.replica_every > 0
            && done.is_multiple_of(self.replica_every)
            && done < self.spec.total_steps
    }

    /// The async window: most micro-batches between the master's forward and its own backward.
    pub(crate) fn async_window(&self) -> usize {
        match self.in_flight {
            0 => self.partition.len(),
            w => w,
        }
    }

    /// The first mini-batch boundary after mini-batch `step` where the async pipeline must be
    /// empty (an evaluation, a checkpoint or a replication round follows it, or the run ends):
    /// micro-batches beyond it must not start before it, or they would still be in the ring
    /// when the evaluation's chunks go round.
    pub(crate) fn next_drain(&self, step: u64) -> u64 {
        (step + 1..=self.spec.total_steps)
            .find(|&done| {
                self.checkpoint_due(done) || self.spec.eval_due(done) || self.replica_due(done)
            })
            .unwrap_or(self.spec.total_steps)
    }

    pub(crate) fn checkpoint_due(&self, done: u64) -> bool {
        self.spec.checkpoint_every > 0
            && (done.is_multiple_of(self.spec.checkpoint_every) || done == self.spec.total_steps)
    }

    pub(crate) fn checkpoint_dir(&self, step: u64) -> std::path::PathBuf {
        self.spec
            .out
            .join("checkpoints")
            .join(checkpoint::checkpoint_dir_name(step))
    }

    /// Writes this node's stage file for `step` and returns its entry as JSON.
    pub(crate) fn write_stage_file(
        &self,
        rank: u32,
        step: u64,
        stage: &Stage,
        optimizer: &Optimizer,
    ) -> Result<String> {
        self.write_stage_file_named(&format!("stage-{rank}"), step, stage, optimizer)
    }

    /// [`RingJob::write_stage_file`] under a given base name.
    pub(crate) fn write_stage_file_named(
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
    pub(crate) fn write_manifest(&self, step: u64, files: &[String]) -> Result<std::path::PathBuf> {
        let files = files
            .iter()
            .map(|f| {
                serde_json::from_str(f).map_err(|e| {
                    Error::Config(format!("a node's checkpoint entry is invalid: {e}"))
                })
            })
            .collect::<Result<Vec<checkpoint::FileEntry>>>()?;
        let dir = self.checkpoint_dir(step);
        let layers = self.layers()?;
        let manifest = self.spec.manifest(
            "ring",
            step,
            // The global batch (rings of rings: all rings' together) fixes the data order.
            self.spec.batch_size * self.replicas.max(1),
            self.partition
                .iter()
                .chain(&self.head)
                .map(|p| Self::model_layers(&layers, p))
                .collect(),
            files,
            Vec::new(),
        );
        checkpoint::write_manifest(&dir, &manifest)?;
        if let Some(keep) = self.spec.keep_checkpoints {
            checkpoint::retain_newest(&self.spec.out.join("checkpoints"), keep)?;
        }
        Ok(dir)
    }
}

/// Counters a node keeps about itself.
pub(crate) struct NodeClock {
    pub(crate) compute: f64,
    /// Wire bytes of evaluation frames this node sent.
    pub(crate) eval_bytes: u64,
    pub(crate) peak_stash: usize,
    pub(crate) speed: f64,
    /// Seconds blocked in receives, by what ended the wait: an activation, a gradient, anything
    /// else (the loop had nothing to do until it came).
    pub(crate) waited: Waits,
    /// The network's clock (wall or virtual): emulated slowness and compute time go through it.
    pub(crate) time: Arc<dyn Clock>,
}

impl NodeClock {
    pub(crate) fn new(net: &dyn Transport, speed: f64) -> Self {
        Self {
            compute: 0.0,
            eval_bytes: 0,
            peak_stash: 0,
            speed,
            waited: Waits::default(),
            time: net.clock(),
        }
    }

    /// Times `f` and accounts for it on the network's clock (which emulates a slower node).
    pub(crate) fn run<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let mut lap = self.lap();
        let out = f();
        self.settle(&mut lap);
        out
    }

    /// Starts timing compute that [`NodeClock::settle`] accounts for: [`NodeClock::run`] in
    /// parts, for compute that acts on the network midway (a split backward sends its input
    /// gradient before its weights), so that what it sends leaves at the right time on an
    /// emulated slower node or a virtual clock.
    pub(crate) fn lap(&self) -> Lap {
        Lap {
            at: self.time.now(),
            wall: Instant::now(),
        }
    }

    /// Accounts for the compute since `lap` started, as [`NodeClock::run`] does.
    pub(crate) fn settle(&mut self, lap: &mut Lap) {
        self.time.computed(lap.wall.elapsed(), self.speed);
        self.compute += (self.time.now() - lap.at).as_secs_f64();
        *lap = self.lap();
    }

    /// Blocks for the next message (at most `timeout`), counting the wait by what it was for.
    pub(crate) fn recv(
        &mut self,
        net: &mut dyn RingNet,
        timeout: Duration,
    ) -> Result<(u32, Message)> {
        let t = self.time.now();
        let arrived = net.recv(timeout)?;
        let waited = (self.time.now() - t).as_secs_f64();
        match &arrived.1 {
            Message::Tensor(h, _) if h.tag == TensorTag::Activation => {
                self.waited.activation += waited
            }
            Message::Tensor(h, _) if h.tag == TensorTag::Gradient => self.waited.gradient += waited,
            _ => self.waited.other += waited,
        }
        Ok(arrived)
    }
}

/// Where a part of a node's compute started, on the network's clock and the wall's.
pub(crate) struct Lap {
    at: Duration,
    wall: Instant,
}

/// Seconds a node spent blocked in receives, split by what ended the wait.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Waits {
    pub(crate) activation: f64,
    pub(crate) gradient: f64,
    pub(crate) other: f64,
}

/// A tensor of `rows` rows of `values`, as `dtype` on the wire.
pub(crate) fn tensor(
    tag: TensorTag,
    step: u64,
    micro_batch: u64,
    rows: usize,
    values: &[f32],
    dtype: Dtype,
) -> Message {
    let width = values.len() / rows.max(1);
    let header = TensorHeader {
        run_id: 0,
        step,
        micro_batch,
        tag,
        dtype,
        shape: vec![rows as u32, width as u32],
    };
    Message::Tensor(header, tensor_bytes(values, dtype))
}

pub(crate) fn protocol(net: &dyn Transport, from: u32, what: &str) -> Error {
    Error::Transport(TransportError::Io {
        context: format!("ring: unexpected {what} from {}", net.peer_name(from)),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not part of the ring protocol",
        ),
    })
}

/// A payload's values as f32.
pub(crate) fn values(bytes: &[u8], dtype: ringtmp_wire::Dtype) -> Vec<f32> {
    let mut out = Vec::new();
    tensor_values(bytes, dtype, &mut out);
    out
}

/// Row offset of micro-batch `mb` within its mini-batch (the same split as the master's).
pub(crate) fn micro_offset(job: &RingJob, mb: usize) -> usize {
    let (base, extra) = (
        job.spec.batch_size / job.micro_batches,
        job.spec.batch_size % job.micro_batches,
    );
    // Rings of rings: ring r's rows follow the r rings before it in the global batch.
    job.ring * job.spec.batch_size + mb * base + mb.min(extra)
}

pub(crate) fn node_summary(
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
    let os = ringtmp_contract::machine::ProcessReadings::of(clock.time.as_ref());
    NodeSummary {
        rank,
        role: role.into(),
        params,
        param_bytes: params * 4,
        optimizer_bytes: optimizer.state_bytes() as u64,
        peak_rss_bytes: os.peak_rss_bytes,
        bytes_sent: links.iter().map(|l| l.bytes_sent).sum(),
        eval_bytes_sent: clock.eval_bytes,
        bytes_received: links.iter().map(|l| l.bytes_received).sum(),
        messages_sent: links.iter().map(|l| l.messages_sent).sum(),
        compute_seconds: clock.compute,
        idle_seconds: (train_seconds - clock.compute).max(0.0),
        wait_seconds: clock.waited.activation + clock.waited.gradient + clock.waited.other,
        wait_activation_seconds: clock.waited.activation,
        wait_gradient_seconds: clock.waited.gradient,
        cpu_seconds: os.cpu_seconds,
        steal_seconds: os.steal_seconds,
        throttled_seconds: os.throttled_seconds,
        bubble_fraction: ((train_seconds - clock.compute) / train_seconds.max(1e-9))
            .clamp(0.0, 1.0),
        peak_stash_bytes: clock.peak_stash as u64,
        // In the model's layer indices: a layer cut inside (its head here, its tail on the next
        // node) appears in both nodes' ranges.
        layers: Some((
            stage.first_layer(),
            stage.layers().last().map_or(plan.end, |l| l.index + 1),
        )),
        // Wall-clock times describe no simulated machine, and would make a computing simulated
        // run's reports longer than a phantom one's (the simulator's phantom-equals-computing
        // invariant counts their bytes on the simulated links).
        layer_seconds: if clock.time.is_virtual() {
            Vec::new()
        } else {
            stage.layer_seconds()
        },
        links: links
            .iter()
            .map(|l| (l.peer, l.bytes_sent, l.bytes_received))
            .collect(),
        ..Default::default()
    }
}
