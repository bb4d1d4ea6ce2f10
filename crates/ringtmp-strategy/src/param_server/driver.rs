//! Parameter-server drivers: `S` servers each own a contiguous shard of the flat parameter vector
//! with its optimizer state; `W` workers each hold a full replica and train on units of work: unit
//! `u` is share `u mod W` of global batch `u div W` (global batches of `W·b` examples, in the same
//! order as `local` with batch `W·b`).
//!
//! Per iteration, worker `w` sends `Pull { clock }` to every server; a server answers with its
//! shard when the consistency model allows (otherwise it parks the request), server 0 adding the
//! unit the worker computes next (`Admission` says who decides what). The worker computes the
//! gradient of its mean loss on that unit and pushes each server its slice, tagged with the unit.
//! Servers apply gradients averaged over the workers: under BSP once per iteration, when every
//! live worker has pushed (exactly large-batch SGD); under SSP, ASP and DSSP as each push
//! arrives, scaled by `1/W`.
//!
//! Clipping by the global norm (`--clip-grad-norm`): under BSP the servers clip the mean
//! gradient, exactly as `local` clips its large batch's — each server's share of the squared
//! norm goes to every other server (`GradNorm`), and a server applies its shard once it has them
//! all, holding its answers to pulls until then. Under SSP, ASP and DSSP there is no step whose
//! gradient all workers share: each worker clips the gradient it pushes (the update it makes).
//!
//! Ranks: servers are `0..S`, workers `S..S+W`.

use std::collections::BTreeSet;
use std::ops::Range;
use std::time::{Duration, Instant};

use ringtmp_data::{BatchPlan, Dataset, shard};
use ringtmp_model::{Optimizer, Pass, Stage, checkpoint, loss};
use ringtmp_transport::{BufferPool, Transport};
use ringtmp_wire::message::{tensor_bytes_into, tensor_values_into, tensor_view};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};
use serde::{Deserialize, Serialize};

pub use super::admission::NO_MORE_WORK;
use super::admission::{Admission, Reply};
use super::consistency::Consistency;
use crate::error::{Error, Result};
use crate::messages::StrategyMessage;
use crate::spec::{ResumePoint, RunSpec};

/// The parameter server's own wire messages (as [`StrategyMessage`]s).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PsMessage {
    /// A worker to a server: it has finished; the server stops waiting for it.
    Finished {
        /// Iterations it completed.
        iterations: u64,
    },
    /// Server 0 to every other server, with each answer under SSP and DSSP: `worker` computes
    /// `unit`, and every unit below `settled` had been pushed to server 0.
    Grant {
        /// The worker (its index among the workers).
        worker: u32,
        /// The unit it was given.
        unit: u64,
        /// The mark below which every unit had been pushed to server 0.
        settled: u64,
    },
    /// A worker to a server: send your shard for its iteration `clock` (its pushes so far).
    Pull {
        /// Pushes the worker has made.
        clock: u64,
    },
    /// A server to every other server under BSP with clipping: the squared L2 norm of its shard
    /// of iteration `iteration`'s mean gradient (the global norm is their sum).
    GradNorm {
        /// The global iteration.
        iteration: u64,
        /// The squared norm, as `f64::to_bits`.
        squared_bits: u64,
    },
}

impl StrategyMessage for PsMessage {
    const STRATEGY: &'static str = "ps";

    fn kind(&self) -> &'static str {
        match self {
            Self::Finished { .. } => "Finished",
            Self::Grant { .. } => "Grant",
            Self::Pull { .. } => "Pull",
            Self::GradNorm { .. } => "GradNorm",
        }
    }
}

/// Everything every node of a parameter-server run must agree on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PsJob {
    /// What every strategy's job shares; its `batch_size` is one worker's share of each global
    /// batch, and its steps count global iterations.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Servers (ranks `0..servers`).
    pub servers: usize,
    /// Workers (ranks `servers..servers + workers`).
    pub workers: usize,
    /// Consistency model.
    pub consistency: Consistency,
    /// Emulated relative speed per rank (1 = full speed; workers only).
    #[serde(default)]
    pub node_speeds: Vec<f64>,
    /// Keep training without a worker that died, even under BSP.
    pub drop_dead_workers: bool,
}

impl PsJob {
    pub(crate) fn layers(&self) -> Result<Vec<ringtmp_model::Layer>> {
        self.spec.layers()
    }

    fn timeout(&self) -> Duration {
        self.spec.recv_timeout()
    }

    fn checkpoint_due(&self, done: u64) -> bool {
        self.spec.checkpoint_due(done)
    }

    fn checkpoint_dir(&self, step: u64) -> std::path::PathBuf {
        self.spec.checkpoint_dir(step)
    }

    /// Examples per worker per iteration.
    pub fn worker_batch(&self) -> usize {
        self.spec.batch_size
    }

    /// Iterations already done when resuming.
    pub fn first_step(&self) -> u64 {
        self.spec.first_step()
    }

    /// The learning rate of the global iteration unit `unit` belongs to.
    fn lr_at_unit(&self, unit: u64) -> f32 {
        self.spec.lr_at(unit / self.workers as u64)
    }
}

/// Contiguous, near-equal shard `s` of `total` parameters over `servers` servers.
pub fn shard_range(total: usize, servers: usize, s: usize) -> Range<usize> {
    let (base, extra) = (total / servers, total % servers);
    let start = s * base + s.min(extra);
    start..start + base + usize::from(s < extra)
}

/// What a server measured, and its final shard.
#[derive(Clone, Debug)]
pub struct ServerOutcome {
    /// The shard's final parameters.
    pub params: Vec<f32>,
    /// Pulls that had to wait for the consistency model.
    pub parked_pulls: u64,
    /// Observed staleness histogram (index = iterations ahead of the slowest worker).
    pub staleness: Vec<u64>,
    /// Workers dropped after dying, with the iteration and the failure observed.
    pub dropped: Vec<ringtmp_metrics::DroppedNode>,
    /// Per worker, its observed staleness histogram at this server.
    pub worker_staleness: Vec<Vec<u64>>,
    /// Update staleness of the pushes applied one at a time (not under BSP).
    pub update_staleness: UpdateStaleness,
    /// End-of-run reports (JSON) that workers sent while this server was still serving others.
    pub reports: Vec<String>,
}

/// How stale the gradients a server applies are, counted in its own updates: a push computed from
/// the parameters sent when the server had applied `a` pushes, applied when it has applied `b`,
/// has staleness `b - a`. Under ASP, SSP and DSSP each push is one update; under BSP an update is
/// a whole iteration and nothing is recorded. The histogram is bounded: the last bucket holds
/// everything at or above it.
#[derive(Clone, Debug, Default)]
pub struct UpdateStaleness {
    /// Pushes applied so far.
    applied: u64,
    /// Per worker, `applied` when it was last sent this shard.
    sent_at: Vec<u64>,
    /// Index = staleness, value = pushes.
    pub histogram: Vec<u64>,
}

impl UpdateStaleness {
    /// Buckets kept; the last one counts every larger staleness too.
    const BUCKETS: usize = 64;

    fn new(workers: usize) -> Self {
        Self {
            applied: 0,
            sent_at: vec![0; workers],
            histogram: Vec::new(),
        }
    }

    fn sent(&mut self, w: usize) {
        self.sent_at[w] = self.applied;
    }

    /// Worker `w`'s push is being applied; returns its staleness.
    fn applying(&mut self, w: usize) -> u64 {
        let tau = self.applied - self.sent_at[w];
        let bucket = (tau as usize).min(Self::BUCKETS - 1);
        if self.histogram.len() <= bucket {
            self.histogram.resize(bucket + 1, 0);
        }
        self.histogram[bucket] += 1;
        self.applied += 1;
        tau
    }

    /// Mean staleness of the pushes applied so far (0 when none were).
    pub fn mean(&self) -> f64 {
        let n: u64 = self.histogram.iter().sum();
        let total: u64 = self
            .histogram
            .iter()
            .enumerate()
            .map(|(t, c)| t as u64 * c)
            .sum();
        total as f64 / n.max(1) as f64
    }
}

/// A tensor message of `values` in a buffer from the node's pool: a gradient push (`step` the
/// worker's iteration, `unit` the unit of work it computed) or a parameter shard (`step` the
/// worker's clock, `unit` its next unit).
fn tensor(
    net: &dyn Transport,
    tag: TensorTag,
    step: u64,
    unit: u64,
    values: &[f32],
    dtype: Dtype,
) -> Message {
    let header = TensorHeader {
        run_id: 0,
        step,
        micro_batch: unit,
        tag,
        dtype,
        shape: vec![values.len() as u32],
    };
    let mut payload = net.buffers().take(values.len() * dtype.size() as usize);
    tensor_bytes_into(values, dtype, &mut payload);
    Message::Tensor(header, payload)
}

/// Runs server `s` (rank `s`) until every worker has finished or been dropped.
pub fn run_server(job: &PsJob, s: usize, net: &mut dyn Transport) -> Result<ServerOutcome> {
    let layers = job.layers()?;
    let total: usize = layers.iter().map(|l| l.param_count()).sum();
    let range = shard_range(total, job.servers, s);
    // The same initial parameters as every other strategy: build the model's initial vector and
    // keep this server's slice.
    let model = Stage::new(&layers, 0..layers.len(), job.spec.seed, 1);
    let mut params = model.params()[range.clone()].to_vec();
    let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), params.len());
    if let Some(ResumePoint { dir, .. }) = &job.spec.resume_from {
        let manifest = checkpoint::read_manifest(dir)?;
        checkpoint::read_range(
            dir,
            &manifest,
            &model,
            range.clone(),
            &mut params,
            &mut optimizer,
        )?;
    }
    let mut checkpoints = Checkpoints {
        range: range.clone(),
        iterations: 0,
        pushes: 0,
        entries: std::collections::BTreeMap::new(),
    };
    let worker = |rank: u32| rank as usize - job.servers;
    let workers = job.workers as u64;
    let mut pulls = Admission::new(
        job.consistency,
        s,
        job.servers,
        job.workers,
        job.first_step() * workers..job.spec.total_steps * workers,
    );
    // The consistency controller's time is the network's (virtual in simulation).
    let time = net.clock();
    let now = || time.now().as_secs_f64();
    let mut finished: BTreeSet<usize> = BTreeSet::new();
    let mut dropped: Vec<u32> = Vec::new();
    let mut drops: Vec<ringtmp_metrics::DroppedNode> = Vec::new();
    let mut reports: Vec<String> = Vec::new();
    let mut bsp = Bsp {
        sum: BspSum::new(job.workers, params.len(), job.spec.lr),
        clip: job
            .spec
            .clip_grad_norm
            .filter(|_| job.consistency == Consistency::Bsp),
        servers: job.servers,
        iteration: job.first_step(),
        waiting: None,
        shares: std::collections::BTreeMap::new(),
        held: Vec::new(),
    };
    let (mut values, mut scratch) = (Vec::new(), Vec::new());
    let scale = 1.0 / job.workers as f32;
    let mut updates = UpdateStaleness::new(job.workers);
    // (An iteration waiting for the other servers' shares of its norm is applied before the end.)
    while finished.len() + dropped.len() < job.workers || bsp.waiting() {
        let (from, message) = match net.recv(job.timeout()) {
            Ok(m) => m,
            Err(e) => {
                // A dead worker: drop it where the consistency model allows, else stop naming it.
                let Some(rank) = e.failed_peer().filter(|r| *r as usize >= job.servers) else {
                    return Err(e.into());
                };
                // A worker that already finished may leave whenever it likes.
                if finished.contains(&worker(rank)) || dropped.contains(&rank) {
                    continue;
                }
                if job.consistency == Consistency::Bsp && !job.drop_dead_workers {
                    return Err(e.into());
                }
                tracing::warn!("server {s}: dropping worker rank {rank}: {e}");
                let replies = pulls.drop_worker(worker(rank), now());
                dropped.push(rank);
                drops.push(ringtmp_metrics::DroppedNode {
                    rank,
                    step: job.first_step() + checkpoints.iterations,
                    reason: e.to_string(),
                });
                // Under BSP the iteration may now be complete without it.
                bsp.sum.forget(worker(rank));
                let live = job.workers - dropped.len();
                if bsp.settle(live, &mut optimizer, &mut params, s, net)? {
                    checkpoints.iteration_done(job, s, &model, &params, &optimizer, net)?;
                    release(&mut bsp, &params, job, &mut updates, net)?;
                }
                answer(
                    &mut bsp,
                    replies,
                    &params,
                    job.servers,
                    job.spec.wire_dtype,
                    &mut updates,
                    net,
                )?;
                continue;
            }
        };
        // The parameter server's own messages, and the rest of the wire's.
        let own = match &message {
            Message::Control(control) => PsMessage::from_control(control, net, from)?,
            Message::Tensor(..) => None,
        };
        if (from as usize) < job.servers {
            // Only another server's end-of-run report can come from a server (to server 0).
            match (own, message) {
                (None, Message::Control(Control::Report { nodes })) if s == 0 => {
                    reports.extend(nodes)
                }
                (None, Message::Control(Control::Checkpoint { step, files })) if s == 0 => {
                    checkpoints.record(job, step, from as usize, files, &model)?;
                }
                (
                    Some(PsMessage::Grant {
                        worker,
                        unit,
                        settled,
                    }),
                    _,
                ) if from == 0 && (worker as usize) < job.workers => {
                    let replies = pulls.grant(worker as usize, unit, settled, now());
                    answer(
                        &mut bsp,
                        replies,
                        &params,
                        job.servers,
                        job.spec.wire_dtype,
                        &mut updates,
                        net,
                    )?;
                }
                (
                    Some(PsMessage::GradNorm {
                        iteration,
                        squared_bits,
                    }),
                    _,
                ) if bsp.clip.is_some() => {
                    bsp.share(from as usize, iteration, f64::from_bits(squared_bits))?;
                    let live = job.workers - dropped.len();
                    if bsp.settle(live, &mut optimizer, &mut params, s, net)? {
                        checkpoints.iteration_done(job, s, &model, &params, &optimizer, net)?;
                        release(&mut bsp, &params, job, &mut updates, net)?;
                    }
                }
                _ => {
                    return Err(Error::Config(format!(
                        "server {s}: unexpected message from server rank {from}"
                    )));
                }
            }
            continue;
        }
        if dropped.contains(&from) {
            // What a worker sent before it died, read after its death was noticed (a link's
            // closure can be reported while the server waits on another link, ahead of what is
            // still queued on its own): it is no longer part of the run.
            continue;
        }
        let w = worker(from);
        match (own, message) {
            (Some(PsMessage::Pull { clock }), _) => {
                let pushed = pulls.gate().pushes(w);
                if pushed != clock {
                    return Err(Error::Config(format!(
                        "server {s}: worker rank {from} pulls for iteration {clock} after pushing {pushed}"
                    )));
                }
                answer(
                    &mut bsp,
                    pulls.pull(w, clock, now()),
                    &params,
                    job.servers,
                    job.spec.wire_dtype,
                    &mut updates,
                    net,
                )?;
            }
            (None, Message::Tensor(h, bytes)) if h.tag == TensorTag::ParamGrads => {
                // The header's count (checked against the payload when the frame was decoded;
                // a phantom run's payload carries no values).
                let count = h.elements().unwrap_or(u64::MAX);
                if count != params.len() as u64 {
                    return Err(Error::Config(format!(
                        "server {s}: gradient of {count} values from rank {from}, shard has {}",
                        params.len()
                    )));
                }
                // The rate of the global iteration the unit belongs to, whoever computed it.
                let lr = job.lr_at_unit(h.micro_batch);
                if job.consistency == Consistency::Bsp {
                    // Keep this iteration's gradients; apply their mean once all live workers pushed.
                    bsp.sum.add(w, bytes, h.dtype, lr);
                    let live = job.workers - dropped.len();
                    if bsp.settle(live, &mut optimizer, &mut params, s, net)? {
                        checkpoints.iteration_done(job, s, &model, &params, &optimizer, net)?;
                        release(&mut bsp, &params, job, &mut updates, net)?;
                    }
                } else {
                    // Each push is 1/W of an iteration's mean gradient.
                    let grads = tensor_view(&bytes, h.dtype, &mut scratch);
                    values.clear();
                    values.extend(grads.iter().map(|g| g * scale));
                    net.buffers().give(bytes);
                    updates.applying(w);
                    optimizer.step(&mut params, &values, lr, 1);
                    checkpoints.push_applied(job, s, &model, &params, &optimizer, net)?;
                }
                let replies = pulls.pushed(w, h.micro_batch, now());
                answer(
                    &mut bsp,
                    replies,
                    &params,
                    job.servers,
                    job.spec.wire_dtype,
                    &mut updates,
                    net,
                )?;
            }
            (None, Message::Control(Control::Report { nodes })) => reports.extend(nodes),
            (Some(PsMessage::Finished { .. }), _) => {
                finished.insert(w);
                answer(
                    &mut bsp,
                    pulls.drop_worker(w, now()),
                    &params,
                    job.servers,
                    job.spec.wire_dtype,
                    &mut updates,
                    net,
                )?;
            }
            (own, other) => {
                let what = match (own, other) {
                    (Some(m), _) => format!("{m:?}"),
                    (None, Message::Control(c)) => format!("{c:?}"),
                    (None, Message::Tensor(h, _)) => {
                        format!("{:?} tensor for step {}", h.tag, h.step)
                    }
                };
                return Err(Error::Config(format!(
                    "server {s}: unexpected {what} from rank {from}"
                )));
            }
        }
    }
    // Server 0 writes a checkpoint's manifest once every server's file is in: wait for the
    // entries still on their way when the workers finished.
    while s == 0 && !checkpoints.entries.is_empty() {
        match net.recv(job.timeout())? {
            (from, Message::Control(Control::Checkpoint { step, files }))
                if (from as usize) < job.servers =>
            {
                checkpoints.record(job, step, from as usize, files, &model)?;
            }
            (from, Message::Control(Control::Report { nodes }))
                if (from as usize) < job.servers =>
            {
                reports.extend(nodes);
            }
            // Workers that finished may still say goodbye; nothing else is expected.
            (from, _) if (from as usize) >= job.servers => {}
            (from, _) => {
                return Err(Error::Config(format!(
                    "server 0: unexpected message from server rank {from} while finishing a checkpoint"
                )));
            }
        }
    }
    Ok(ServerOutcome {
        params,
        parked_pulls: pulls.parked_count(),
        staleness: pulls.gate().staleness_histogram().to_vec(),
        worker_staleness: (0..job.workers)
            .map(|w| pulls.gate().worker_staleness(w).to_vec())
            .collect(),
        update_staleness: updates,
        dropped: drops,
        reports,
    })
}

/// Sends `replies` now, or holds them while a BSP iteration waits for the other servers' shares
/// of its norm (a shard sent then would miss the iteration's update).
fn answer(
    bsp: &mut Bsp,
    replies: Vec<Reply>,
    params: &[f32],
    servers: usize,
    dtype: Dtype,
    staleness: &mut UpdateStaleness,
    net: &mut dyn Transport,
) -> Result<()> {
    if bsp.waiting() {
        bsp.held.extend(replies);
        return Ok(());
    }
    send_replies(replies, params, servers, dtype, staleness, net)
}

/// Sends the answers held while the iteration just applied waited.
fn release(
    bsp: &mut Bsp,
    params: &[f32],
    job: &PsJob,
    staleness: &mut UpdateStaleness,
    net: &mut dyn Transport,
) -> Result<()> {
    let held = std::mem::take(&mut bsp.held);
    send_replies(
        held,
        params,
        job.servers,
        job.spec.wire_dtype,
        staleness,
        net,
    )
}

/// Sends what the admission decided: shards to workers, grants to the other servers.
fn send_replies(
    replies: Vec<Reply>,
    params: &[f32],
    servers: usize,
    dtype: Dtype,
    staleness: &mut UpdateStaleness,
    net: &mut dyn Transport,
) -> Result<()> {
    for reply in replies {
        match reply {
            Reply::Params {
                worker,
                clock,
                unit,
            } => {
                staleness.sent(worker);
                send_params(worker, clock, unit, params, servers, dtype, net)?
            }
            Reply::Grant {
                to,
                worker,
                unit,
                settled,
            } => net.send(
                to as u32,
                PsMessage::Grant {
                    worker: worker as u32,
                    unit,
                    settled,
                }
                .to_message(),
            )?,
        }
    }
    Ok(())
}

/// Sends worker `w` this server's shard for its iteration `clock` (from server 0 with the unit of
/// work it does next).
fn send_params(
    w: usize,
    clock: u64,
    unit: u64,
    params: &[f32],
    servers: usize,
    dtype: Dtype,
    net: &mut dyn Transport,
) -> Result<()> {
    let message = tensor(net, TensorTag::Params, clock, unit, params, dtype);
    net.send((servers + w) as u32, message)?;
    Ok(())
}

/// BSP's iteration in progress: each worker's pushed gradient, kept as it arrived, until every
/// live worker has pushed. The mean is then summed in worker order, so a run's parameters do not
/// depend on the order in which pushes happened to arrive (float addition is not associative).
/// Memory: up to `W` gradients of the shard, which the received messages occupy anyway.
struct BspSum {
    /// Per worker, its gradient payload for this iteration (a dead worker's stays).
    pushed: Vec<Option<(Vec<u8>, Dtype)>>,
    /// Live workers that pushed this iteration.
    awaited_pushed: BTreeSet<usize>,
    sum: Vec<f32>,
    scratch: Vec<f32>,
    lr: f32,
}

impl BspSum {
    fn new(workers: usize, shard: usize, lr: f32) -> Self {
        Self {
            pushed: vec![None; workers],
            awaited_pushed: BTreeSet::new(),
            sum: vec![0.0; shard],
            scratch: Vec::new(),
            lr,
        }
    }

    fn add(&mut self, w: usize, payload: Vec<u8>, dtype: Dtype, lr: f32) {
        self.pushed[w] = Some((payload, dtype));
        self.awaited_pushed.insert(w);
        self.lr = lr;
    }

    /// A dead worker is no longer awaited; a gradient it already pushed stays in the sum.
    fn forget(&mut self, w: usize) {
        self.awaited_pushed.remove(&w);
    }

    /// Whether every one of `live` workers has pushed this iteration.
    fn complete(&self, live: usize) -> bool {
        !self.awaited_pushed.is_empty() && self.awaited_pushed.len() >= live
    }

    /// The mean of the pushed gradients, in `sum` (in worker order); returns its squared L2
    /// norm, which clipping needs.
    fn take_mean(&mut self, buffers: &BufferPool) -> f64 {
        let phantom = ringtmp_meter::phantom();
        if !phantom {
            self.sum.fill(0.0);
        }
        let mut contributions = 0;
        for (payload, dtype) in self.pushed.iter_mut().filter_map(Option::take) {
            let grads = tensor_view(&payload, dtype, &mut self.scratch);
            for (a, g) in self.sum.iter_mut().zip(grads) {
                *a += g;
            }
            contributions += 1;
            buffers.give(payload);
        }
        let mean = 1.0 / contributions as f32;
        if phantom {
            return 0.0;
        }
        self.sum.iter_mut().for_each(|v| *v *= mean);
        self.sum.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
    }

    /// Applies the mean (times `factor`, the clipping's) and starts the next iteration.
    fn apply(&mut self, factor: f32, optimizer: &mut Optimizer, params: &mut [f32]) {
        if factor != 1.0 && !ringtmp_meter::phantom() {
            self.sum.iter_mut().for_each(|v| *v *= factor);
        }
        optimizer.step(params, &self.sum, self.lr, 1);
        self.awaited_pushed.clear();
    }
}

/// BSP's iterations on one server: the mean applied once every live worker has pushed, clipped
/// by the global norm when asked — with several servers, once every server's share of the
/// squared norm has arrived. While a clipped iteration waits for those shares, the answers to
/// pulls wait too (they must carry the updated shard).
///
/// Invariants: iterations are applied in order, one at a time; the factor of an iteration is the
/// same on every server (the same shares summed); no shard leaves the server between an
/// iteration's completion and its application.
struct Bsp {
    sum: BspSum,
    clip: Option<f32>,
    servers: usize,
    /// The global iteration in progress.
    iteration: u64,
    /// This iteration's own squared norm, once it is complete and waits for the others'.
    waiting: Option<f64>,
    /// Every server's share by iteration, by server (summed in server order, so every server
    /// computes the same norm to the bit).
    shares: std::collections::BTreeMap<u64, std::collections::BTreeMap<usize, f64>>,
    /// Answers held while an iteration waits.
    held: Vec<Reply>,
}

impl Bsp {
    /// Whether an iteration is complete but not applied yet.
    fn waiting(&self) -> bool {
        self.waiting.is_some()
    }

    /// Applies the iteration if every one of `live` workers has pushed and — when clipping over
    /// several servers — every server's share of the norm is in (telling the others this
    /// server's share once it is complete). Returns whether it applied.
    fn settle(
        &mut self,
        live: usize,
        optimizer: &mut Optimizer,
        params: &mut [f32],
        s: usize,
        net: &mut dyn Transport,
    ) -> Result<bool> {
        if self.waiting.is_none() {
            if !self.sum.complete(live) {
                return Ok(false);
            }
            let own = self.sum.take_mean(net.buffers());
            if self.clip.is_none() {
                self.sum.apply(1.0, optimizer, params);
                self.iteration += 1;
                return Ok(true);
            }
            self.waiting = Some(own);
            self.shares
                .entry(self.iteration)
                .or_default()
                .insert(s, own);
            let share = PsMessage::GradNorm {
                iteration: self.iteration,
                squared_bits: own.to_bits(),
            };
            for other in (0..self.servers).filter(|o| *o != s) {
                net.send(other as u32, share.to_message())?;
            }
        }
        let (Some(_), Some(max_norm)) = (self.waiting, self.clip) else {
            return Ok(false);
        };
        let Some(shares) = self.shares.get(&self.iteration) else {
            return Ok(false);
        };
        if shares.len() < self.servers {
            return Ok(false);
        }
        let squared: f64 = shares.values().sum();
        let factor = crate::clipping::clip_factor(squared.sqrt(), max_norm);
        self.sum.apply(factor, optimizer, params);
        self.shares.remove(&self.iteration);
        self.waiting = None;
        self.iteration += 1;
        Ok(true)
    }

    /// Server `from`'s share of iteration `iteration`'s squared norm.
    fn share(&mut self, from: usize, iteration: u64, squared: f64) -> Result<()> {
        let shares = self.shares.entry(iteration).or_default();
        if iteration < self.iteration
            || !squared.is_finite()
            || squared < 0.0
            || shares.insert(from, squared).is_some()
        {
            return Err(Error::Config(format!(
                "server rank {from}'s share of the gradient norm for iteration {iteration} \
                 ({squared}) comes at iteration {}, or again",
                self.iteration
            )));
        }
        Ok(())
    }
}

/// A server's checkpointing: it counts iterations applied to its shard (under BSP one per
/// applied mean; otherwise one per `W` pushes) and, at each checkpoint step, writes its shard
/// file and tells server 0, which writes the manifest once every server's entry is in.
///
/// Under BSP every server's file holds exactly iteration `step`'s parameters. Under the other
/// models servers apply pushes as they come, so each file holds `step · W` pushes but not
/// necessarily the same ones: the checkpoint is what a worker could have pulled, not one global
/// instant, and a resumed run restarts the data at unit `step · W`.
struct Checkpoints {
    range: Range<usize>,
    iterations: u64,
    pushes: u64,
    /// Server 0: checkpoint step → each server's file entry (JSON) that has arrived.
    entries: std::collections::BTreeMap<u64, Vec<Option<String>>>,
}

impl Checkpoints {
    fn push_applied(
        &mut self,
        job: &PsJob,
        s: usize,
        model: &Stage,
        params: &[f32],
        optimizer: &Optimizer,
        net: &mut dyn Transport,
    ) -> Result<()> {
        self.pushes += 1;
        if self.pushes % job.workers as u64 == 0 {
            self.iteration_done(job, s, model, params, optimizer, net)?;
        }
        Ok(())
    }

    fn iteration_done(
        &mut self,
        job: &PsJob,
        s: usize,
        model: &Stage,
        params: &[f32],
        optimizer: &Optimizer,
        net: &mut dyn Transport,
    ) -> Result<()> {
        self.iterations += 1;
        if s == 0 {
            net.step_done();
        }
        let step = job.first_step() + self.iterations;
        if !job.checkpoint_due(step) {
            return Ok(());
        }
        let entry = checkpoint::write_range(
            &job.checkpoint_dir(step),
            &format!("server-{s}.safetensors"),
            model,
            self.range.clone(),
            params,
            optimizer,
        )?;
        let entry = serde_json::to_string(&entry).map_err(|e| Error::Config(e.to_string()))?;
        if s == 0 {
            self.record(job, step, 0, vec![entry], model)
        } else {
            net.send(
                0,
                Message::Control(Control::Checkpoint {
                    step,
                    files: vec![entry],
                }),
            )?;
            Ok(())
        }
    }

    /// Server 0: server `from`'s file for `step`; the manifest once all are in.
    fn record(
        &mut self,
        job: &PsJob,
        step: u64,
        from: usize,
        files: Vec<String>,
        model: &Stage,
    ) -> Result<()> {
        let slots = self
            .entries
            .entry(step)
            .or_insert_with(|| vec![None; job.servers]);
        let [entry] = <[String; 1]>::try_from(files).map_err(|_| {
            Error::Config(format!(
                "server rank {from}: a checkpoint entry must name one file"
            ))
        })?;
        slots[from] = Some(entry);
        if slots.iter().any(Option::is_none) {
            return Ok(());
        }
        let files = self
            .entries
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .map(|f| {
                serde_json::from_str(&f).map_err(|e| {
                    Error::Config(format!("a server's checkpoint entry is invalid: {e}"))
                })
            })
            .collect::<Result<Vec<checkpoint::FileEntry>>>()?;
        let total = model.params().len();
        let manifest = job.spec.manifest(
            "ps",
            step,
            job.spec.batch_size * job.workers,
            (0..job.servers)
                .map(|s| checkpoint::range_layers(model, &shard_range(total, job.servers, s)))
                .collect(),
            files,
            Vec::new(),
        );
        checkpoint::write_manifest(&job.checkpoint_dir(step), &manifest)?;
        if let Some(keep) = job.spec.keep_checkpoints {
            checkpoint::retain_newest(&job.spec.out.join("checkpoints"), keep)?;
        }
        Ok(())
    }
}

/// What a worker measured.
#[derive(Clone, Debug, Default)]
pub struct WorkerOutcome {
    /// Iterations completed.
    pub iterations: u64,
    /// Seconds spent waiting for parameters (at the servers' gates and on the links).
    pub wait_seconds: f64,
    /// Seconds of compute.
    pub compute_seconds: f64,
    /// Examples processed.
    pub samples: u64,
    /// Sum of the mean losses of the units of the run's final epoch this worker computed.
    pub final_epoch_loss_sum: f64,
    /// Units of the run's final epoch this worker computed.
    pub final_epoch_units: u64,
}

/// What a worker tells its caller as it goes.
pub enum WorkerEvent<'a> {
    /// A pull brought work: the replica, and the global iteration of the unit it brought
    /// (under BSP the iterations the parameters hold), e.g. to evaluate it.
    Pulled {
        /// Global iteration of the unit.
        iteration: u64,
        /// The replica as pulled.
        stage: &'a mut Stage,
    },
    /// The worker pushed its gradient for a unit of global iteration `iteration`.
    Pushed {
        /// Global iteration of the unit.
        iteration: u64,
        /// Mean training loss of the unit's examples.
        loss: f64,
        /// The learning rate the servers apply to it.
        lr: f32,
    },
}

/// Runs worker `w` (rank `servers + w`) for the job's iterations on its share of every global
/// batch (the units server 0 assigns); `speed` < 1 emulates a slower node. The returned replica
/// holds the parameters of the last pull (under BSP, the final ones). `on_event` sees every pull
/// that brought work and every push.
pub fn run_worker(
    job: &PsJob,
    w: usize,
    data: &Dataset,
    speed: f64,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(WorkerEvent<'_>) -> Result<()>,
) -> Result<(WorkerOutcome, Stage)> {
    let layers = job.layers()?;
    let mut stage = Stage::new(&layers, 0..layers.len(), job.spec.seed, job.spec.threads);
    let total = stage.params().len();
    let ranges: Vec<Range<usize>> = (0..job.servers)
        .map(|s| shard_range(total, job.servers, s))
        .collect();
    let mut plan = BatchPlan::new(
        data.train.len(),
        job.spec.batch_size * job.workers,
        job.spec.seed,
    )?;
    let (mut x, mut y, mut d) = (Vec::new(), Vec::new(), Vec::new());
    let mut out = WorkerOutcome::default();
    let clock = net.clock();
    // The epoch of the run's last iteration: its units' losses make the run's final train loss.
    let final_epoch = job.spec.total_steps.saturating_sub(1) / job.spec.steps_per_epoch.max(1);
    // Pulls every shard for iteration `t`; returns the unit of work server 0 assigned.
    let pull = |t: u64,
                stage: &mut Stage,
                out: &mut WorkerOutcome,
                net: &mut dyn Transport|
     -> Result<u64> {
        let mut unit = NO_MORE_WORK;
        let waited = net.clock().now();
        for s in 0..job.servers {
            net.send(s as u32, PsMessage::Pull { clock: t }.to_message())?;
        }
        for (s, range) in ranges.iter().enumerate() {
            match net.recv_from(s as u32, job.timeout())? {
                Message::Tensor(h, bytes) if h.tag == TensorTag::Params && h.step == t => {
                    if s == 0 {
                        unit = h.micro_batch;
                    }
                    let values = h.elements().unwrap_or(u64::MAX);
                    if values != range.len() as u64 {
                        return Err(Error::Config(format!(
                            "worker {w}: shard of {values} values from server {s}, expected {}",
                            range.len()
                        )));
                    }
                    tensor_values_into(&bytes, h.dtype, &mut stage.params_mut()[range.clone()]);
                    net.buffers().give(bytes);
                }
                _ => {
                    return Err(Error::Config(format!(
                        "worker {w}: unexpected message from server {s}"
                    )));
                }
            }
        }
        out.wait_seconds += (net.clock().now() - waited).as_secs_f64();
        Ok(unit)
    };
    // Pull, work on the assigned unit, push — until server 0 says there is no more work (the last
    // pull leaves the replica with the current parameters).
    for t in 0.. {
        let unit = pull(t, &mut stage, &mut out, net)?;
        if unit == NO_MORE_WORK {
            break;
        }
        let workers = job.workers as u64;
        let (global, share) = (unit / workers, (unit % workers) as usize);
        on_event(WorkerEvent::Pulled {
            iteration: global,
            stage: &mut stage,
        })?;
        let computed = Instant::now();
        let computed_at = clock.now();
        let epoch = global / job.spec.steps_per_epoch;
        let batch = plan
            .batch(epoch, (global % job.spec.steps_per_epoch) as usize)
            .to_vec();
        let mine = shard(&batch, share, job.workers)?;
        data.train.gather(mine, &mut x, &mut y);
        let pass = Pass {
            train: true,
            seed: job.spec.seed,
            step: global,
            row_offset: share * job.spec.batch_size,
        };
        let logits = stage.forward(0, &x, mine.len(), &pass)?;
        d.resize(logits.len(), 0.0);
        let unit_loss = loss::softmax_cross_entropy(
            logits,
            &y,
            job.spec.classes,
            1.0 / y.len() as f32,
            &mut d,
        )?;
        if epoch == final_epoch {
            out.final_epoch_loss_sum += unit_loss.loss_sum / y.len() as f64;
            out.final_epoch_units += 1;
        }
        stage.backward(0, &d)?;
        if let Some(max_norm) = job.spec.clip_grad_norm
            && job.consistency != Consistency::Bsp
        {
            // No step's gradient is shared under a stale model: each worker clips its own.
            crate::clipping::clip_whole(&mut stage, max_norm);
        }
        clock.computed(computed.elapsed(), speed);
        out.compute_seconds += (clock.now() - computed_at).as_secs_f64();
        for (s, range) in ranges.iter().enumerate() {
            net.send(
                s as u32,
                tensor(
                    net,
                    TensorTag::ParamGrads,
                    t,
                    unit,
                    &stage.grads()[range.clone()],
                    job.spec.wire_dtype,
                ),
            )?;
        }
        stage.zero_grad();
        out.iterations += 1;
        out.samples += mine.len() as u64;
        on_event(WorkerEvent::Pushed {
            iteration: global,
            loss: unit_loss.loss_sum / y.len() as f64,
            lr: job.lr_at_unit(unit),
        })?;
    }
    for s in 0..job.servers {
        net.send(
            s as u32,
            PsMessage::Finished {
                iterations: out.iterations,
            }
            .to_message(),
        )?;
    }
    Ok((out, stage))
}
