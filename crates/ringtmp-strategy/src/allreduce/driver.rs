//! One worker of ring all-reduce SGD: every worker holds a replica, computes the gradient of its
//! share of each global batch, and the workers average their gradients with the ring all-reduce
//! of [`super::ring`] before every worker applies the same step.
//!
//! Gradients go out in buckets as backward produces them, last layer first (PyTorch DDP's
//! buckets): the between-layers hook of [`Stage::backward_streaming`] starts each bucket whose
//! layers are done and moves every bucket in progress as far as what has arrived allows, so the
//! reduction overlaps the rest of the backward pass. Messages of a bucket that this worker has
//! not started yet wait in that bucket until it has.
//!
//! A dead worker breaks the reduction in progress; rank 0 re-forms the ring on the survivors
//! (`Control::Regroup` and its state), and everyone goes on from rank 0's step with the same
//! global batch (docs/decisions/strategy-shape.md, "Elastic all-reduce").
//!
//! Invariants: every chunk is summed in the plan's fixed order, so a run is reproducible and the
//! replicas stay bit-identical (also after a re-formation, which starts from one replica); chunks
//! carry the ring's generation, so none from an abandoned attempt is ever summed; the step's mean
//! loss travels in bucket 0's last slot; every wait has the job's timeout and names the peer.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::{DroppedNode, Summary};
use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::{tensor_bytes_into, tensor_values, tensor_values_into};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};
use serde_json::json;

use super::AllReduceJob;
use super::regroup::{AllReduceMessage, ChunkFate, Follow, FollowAction, Lead, LeadAction, Order};
use super::ring::{RingPlan, chunks};
use crate::data_parallel::write_model;
use crate::error::{Error, Result};
use crate::messages::StrategyMessage;
use crate::spec::ResumePoint;

/// One bucket: a contiguous range of the flat gradient buffer reduced as one all-reduce.
struct Bucket {
    /// The gradients it covers.
    range: Range<usize>,
    /// Its values while it is reduced (bucket 0 carries the step's loss in one more slot).
    values: Vec<f32>,
    /// Its chunks.
    chunks: Vec<Range<usize>>,
    /// The next protocol step (`None` until the bucket's gradients are complete).
    step: Option<usize>,
    /// Chunks that arrived before this worker got there, by protocol step.
    early: BTreeMap<usize, Vec<f32>>,
}

/// The buckets of a replica: layers from the last, grouped until a bucket holds `bytes`.
pub fn buckets(stage: &Stage, bytes: usize) -> Vec<Range<usize>> {
    let ranges: Vec<Range<usize>> = stage
        .param_ranges()
        .map(|(_, r)| r)
        .filter(|r| !r.is_empty())
        .collect();
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges.into_iter().rev() {
        match out.last_mut() {
            Some(last) if (last.len() * 4) < bytes => last.start = r.start,
            _ => out.push(r),
        }
    }
    out
}

/// Why a reduction stopped before its end: the run goes on, on a re-formed ring.
enum Break {
    /// A member died (seen on this worker's own link to it).
    Lost {
        /// The dead rank.
        rank: u32,
        /// The failure observed.
        reason: String,
    },
    /// Rank 0 re-formed the ring (its state tensor follows on the link from rank 0).
    Regroup(Order),
}

/// The ring a reduction runs on: the live workers in ring order, and how many times it has been
/// re-formed (chunks carry it, so those of an abandoned attempt are recognised).
#[derive(Clone, Debug)]
struct Ring {
    members: Vec<u32>,
    generation: u64,
}

impl Ring {
    fn position(&self, rank: u32) -> Option<usize> {
        self.members.iter().position(|r| *r == rank)
    }
}

/// A reduced bucket: the gradients it covers and their sums (bucket 0 also the loss's).
type Reduced = (Range<usize>, Vec<f32>);

/// The reduction of one iteration's gradients.
struct Reducer {
    plan: RingPlan,
    succ: u32,
    pred: u32,
    iteration: u64,
    generation: u64,
    members: Vec<u32>,
    buckets: Vec<Bucket>,
    /// Values bucket 0 carries beyond its gradients (the loss: 1, or none).
    extra: usize,
    timeout: Duration,
    /// Set when the reduction cannot finish on this ring.
    broken: Option<Break>,
    /// Messages for later (another protocol's, or a newer generation's), in arrival order.
    later: Vec<(u32, Message)>,
    /// What chunks travel as.
    wire: Dtype,
}

/// `micro_batch` of a chunk message: the ring's generation, its bucket and protocol step.
fn chunk_id(generation: u64, bucket: usize, step: usize) -> u64 {
    (generation << 48) | ((bucket as u64) << 32) | step as u64
}

/// A chunk id's generation, bucket and protocol step.
fn chunk_parts(id: u64) -> (u64, usize, usize) {
    (
        id >> 48,
        ((id >> 32) & 0xffff) as usize,
        (id & 0xffff_ffff) as usize,
    )
}

/// Most buckets a reduction may have (the width of the bucket field of a chunk id).
const MAX_BUCKETS: usize = 1 << 16;

impl Reducer {
    /// The reduction of `ranges` (buckets) among the members of `ring`, of which `rank` is one;
    /// bucket 0 carries `extra` more values (the step's loss).
    fn new(
        rank: u32,
        ring: &Ring,
        ranges: &[Range<usize>],
        extra: usize,
        iteration: u64,
        timeout: Duration,
        wire: Dtype,
    ) -> Self {
        let n = ring.members.len();
        let at = ring.position(rank).expect("a member reduces");
        let buckets = ranges
            .iter()
            .enumerate()
            .map(|(b, r)| {
                let len = r.len() + if b == 0 { extra } else { 0 };
                Bucket {
                    range: r.clone(),
                    values: Vec::new(),
                    chunks: chunks(len, n),
                    step: None,
                    early: BTreeMap::new(),
                }
            })
            .collect();
        Self {
            plan: RingPlan { rank: at, n },
            succ: ring.members[(at + 1) % n],
            pred: ring.members[(at + n - 1) % n],
            iteration,
            generation: ring.generation,
            members: ring.members.clone(),
            buckets,
            extra,
            timeout,
            broken: None,
            later: Vec::new(),
            wire,
        }
    }

    /// A transport failure: a dead member breaks the reduction (the run goes on without it);
    /// rank 0's death, or anything else, ends the run.
    fn failed(&mut self, e: TransportError) -> Result<()> {
        match e.failed_peer() {
            Some(0) | None => Err(e.into()),
            Some(dead) if !self.members.contains(&dead) => Ok(()),
            Some(dead) => {
                if self.broken.is_none() {
                    self.broken = Some(Break::Lost {
                        rank: dead,
                        reason: e.to_string(),
                    });
                }
                Ok(())
            }
        }
    }

    /// Starts every bucket whose gradients are complete: those from `offset` on, in `tail`
    /// (`grads[offset..]`); bucket 0 also takes `loss`.
    fn start_ready(
        &mut self,
        offset: usize,
        tail: &[f32],
        loss: f32,
        net: &mut dyn Transport,
    ) -> Result<()> {
        for b in 0..self.buckets.len() {
            if self.broken.is_some() {
                return Ok(());
            }
            let bucket = &mut self.buckets[b];
            if bucket.step.is_some() || bucket.range.start < offset {
                continue;
            }
            let local = bucket.range.start - offset..bucket.range.end - offset;
            if ringtmp_meter::phantom() {
                // Sizes only: the bucket holds no values (its chunks' sizes come from
                // `bucket.chunks`), so no node ever holds a model's worth of them.
                bucket.values.clear();
            } else {
                bucket.values.clear();
                bucket.values.extend_from_slice(&tail[local]);
                if b == 0 && self.extra > 0 {
                    bucket.values.push(loss);
                }
            }
            bucket.step = Some(0);
            self.send(b, net)?;
            self.advance(b, net)?;
        }
        Ok(())
    }

    /// Sends bucket `b`'s chunk for its current step.
    fn send(&mut self, b: usize, net: &mut dyn Transport) -> Result<()> {
        let (wire, all_gather) = (self.wire, self.plan.n - 1);
        let bucket = &mut self.buckets[b];
        let Some(s) = bucket.step.filter(|s| *s < self.plan.steps()) else {
            return Ok(());
        };
        let range = bucket.chunks[self.plan.send_chunk(s)].clone();
        let phantom = bucket.values.is_empty() && ringtmp_meter::phantom();
        let chunk: &mut [f32] = if phantom {
            &mut []
        } else {
            &mut bucket.values[range.clone()]
        };
        let mut payload = net.buffers().take(chunk.len() * wire.size() as usize);
        tensor_bytes_into(chunk, wire, &mut payload);
        if s >= all_gather && wire != Dtype::F32 && !phantom {
            // A complete chunk leaves rounded to the wire type; its owner keeps the same
            // rounded values, so every replica applies the same bits.
            tensor_values_into(&payload, wire, chunk);
        }
        let header = TensorHeader {
            run_id: 0,
            step: self.iteration,
            micro_batch: chunk_id(self.generation, b, s),
            tag: TensorTag::ParamGrads,
            dtype: wire,
            shape: vec![range.len() as u32],
        };
        match net.send(self.succ, Message::Tensor(header, payload)) {
            Ok(()) => Ok(()),
            Err(e) => self.failed(e),
        }
    }

    /// Applies every chunk of bucket `b` that has already arrived, step by step.
    fn advance(&mut self, b: usize, net: &mut dyn Transport) -> Result<()> {
        while self.broken.is_none() {
            let bucket = &mut self.buckets[b];
            let Some(s) = bucket.step.filter(|s| *s < self.plan.steps()) else {
                return Ok(());
            };
            let Some(values) = bucket.early.remove(&s) else {
                return Ok(());
            };
            // A phantom run's chunks (sizes only, `ringtmp_meter`) carry no values to combine.
            let elided = values.is_empty() && ringtmp_meter::phantom();
            let range = bucket.chunks[self.plan.recv_chunk(s)].clone();
            let target: &mut [f32] = if elided {
                &mut []
            } else {
                &mut bucket.values[range.clone()]
            };
            if values.len() != range.len() && !elided {
                return Err(Error::protocol(
                    "all-reduce",
                    net,
                    self.pred,
                    &format!(
                        "a chunk of {} values where {} were due",
                        values.len(),
                        range.len()
                    ),
                ));
            }
            if elided {
            } else if self.plan.adds(s) {
                target.iter_mut().zip(&values).for_each(|(t, v)| *t += v);
            } else {
                target.copy_from_slice(&values);
            }
            bucket.step = Some(s + 1);
            self.send(b, net)?;
        }
        Ok(())
    }

    /// Takes in one message: a chunk of this iteration from the predecessor, a stale chunk
    /// (dropped), rank 0's order to re-form the ring, or something for later.
    fn take(&mut self, from: u32, message: Message, net: &mut dyn Transport) -> Result<()> {
        match message {
            Message::Tensor(h, bytes) if h.tag == TensorTag::ParamGrads => {
                let (generation, b, s) = chunk_parts(h.micro_batch);
                if generation < self.generation {
                    // Of an attempt abandoned when the ring was re-formed.
                    net.buffers().give(bytes);
                    return Ok(());
                }
                if generation > self.generation {
                    self.later.push((from, Message::Tensor(h, bytes)));
                    return Ok(());
                }
                if from != self.pred || h.step != self.iteration {
                    return Err(Error::protocol(
                        "all-reduce",
                        net,
                        from,
                        &format!("chunk of step {}", h.step),
                    ));
                }
                if b >= self.buckets.len() || s >= self.plan.steps() {
                    return Err(Error::protocol(
                        "all-reduce",
                        net,
                        from,
                        "chunk of no bucket",
                    ));
                }
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                net.buffers().give(bytes);
                self.buckets[b].early.insert(s, values);
                self.advance(b, net)
            }
            Message::Control(Control::Regroup {
                generation,
                members,
                step,
                optimizer_steps,
            }) if from == 0 && generation > self.generation => {
                self.broken = Some(Break::Regroup(Order {
                    generation,
                    members,
                    step,
                    optimizer_steps,
                }));
                Ok(())
            }
            other => {
                self.later.push((from, other));
                Ok(())
            }
        }
    }

    /// Handles whatever has arrived, without waiting.
    fn pump(&mut self, net: &mut dyn Transport) -> Result<()> {
        while self.broken.is_none() {
            match net.try_recv() {
                Ok(Some((from, message))) => self.take(from, message, net)?,
                Ok(None) => return Ok(()),
                Err(e) => self.failed(e)?,
            }
        }
        Ok(())
    }

    fn done(&self) -> bool {
        self.broken.is_some()
            || self
                .buckets
                .iter()
                .all(|b| b.step == Some(self.plan.steps()))
    }

    /// Waits until every bucket is reduced or the ring breaks. Any peer may speak (rank 0 to
    /// re-form the ring; a failure on any link is news), but only the predecessor's silence is
    /// an error, named.
    fn finish(&mut self, net: &mut dyn Transport) -> Result<()> {
        while !self.done() {
            match net.recv(self.timeout) {
                Ok((from, message)) => self.take(from, message, net)?,
                Err(TransportError::Timeout { waited, .. }) => {
                    return Err(TransportError::Timeout {
                        what: "a chunk of the all-reduce".into(),
                        from: net.peer_name(self.pred).to_string(),
                        waited,
                    }
                    .into());
                }
                Err(e) => self.failed(e)?,
            }
        }
        Ok(())
    }

    /// Puts back what arrived for later, in its order; the reduced buckets, or why the
    /// reduction broke.
    fn close(self, net: &mut dyn Transport) -> std::result::Result<Vec<Reduced>, Break> {
        for (from, message) in self.later.into_iter().rev() {
            net.unread(from, message);
        }
        match self.broken {
            Some(b) => Err(b),
            None => Ok(self
                .buckets
                .into_iter()
                .map(|b| (b.range, b.values))
                .collect()),
        }
    }
}

/// What a worker returns: its replica, and on rank 0 the run's summary.
pub struct WorkerOutcome {
    /// The replica's final parameters (the same bits on every worker).
    pub stage: Stage,
    /// Rank 0's summary of the run.
    pub summary: Option<Summary>,
}

/// Rank 0's parameters and optimizer state, flat: what a re-formed ring starts from.
fn flat_state(stage: &Stage, optimizer: &Optimizer) -> Vec<f32> {
    let mut state = stage.params().to_vec();
    for (_, values) in optimizer.state() {
        state.extend_from_slice(values);
    }
    state
}

/// Rank 0 re-forms the ring without `dead`, carrying out what [`Lead`] decides: every other
/// member gets the order and answers with the steps it has completed; rank 0 sends its state only
/// to the members whose count differs from its own — replicas that completed the same steps hold
/// the same bits, so in the usual case no state travels at all, where sending it to every
/// survivor over rank 0's one card cost 5 s per survivor at 100 Mbit/s (docs/BENCHMARKS.md,
/// "Failures per node-hour"). All go on from `step` (rank 0 abandons the step in progress, so it
/// has completed exactly the steps before it; a worker that completed one more redoes it, one
/// that completed one fewer catches up).
#[allow(clippy::too_many_arguments)]
fn reform_ring(
    net: &mut dyn Transport,
    ring: &mut Ring,
    dead: u32,
    reason: String,
    step: u64,
    stage: &Stage,
    optimizer: &Optimizer,
    dropped: &mut Vec<DroppedNode>,
    timeout: Duration,
    notices: &mut Vec<String>,
) -> Result<()> {
    let (mut lead, first) = Lead::start(
        &ring.members,
        ring.generation,
        dead,
        reason,
        step,
        optimizer.steps(),
    );
    let mut actions: VecDeque<LeadAction> = first.into();
    let mut state: Option<Vec<f32>> = None;
    // A peer's death is the machine's to handle; rank 0's own failure, or any other, ends here.
    let lost = |e: TransportError| match e.failed_peer() {
        Some(other) if other != 0 => Ok((other, e.to_string())),
        _ => Err(Error::from(e)),
    };
    loop {
        let Some(action) = actions.pop_front() else {
            actions.extend(lead.handle_idle());
            continue;
        };
        match action {
            LeadAction::Notice(text) => notices.push(text),
            LeadAction::Dropped { rank, step, reason } => {
                dropped.push(DroppedNode { rank, step, reason });
            }
            LeadAction::SendOrder { to, order } => {
                let order = Control::Regroup {
                    generation: order.generation,
                    members: order.members,
                    step: order.step,
                    optimizer_steps: order.optimizer_steps,
                };
                if let Err(e) = net.send(to, Message::Control(order)) {
                    let (rank, why) = lost(e)?;
                    actions.extend(lead.handle_lost(rank, why));
                }
            }
            LeadAction::SendState { to, generation } => {
                let values = state.get_or_insert_with(|| flat_state(stage, optimizer));
                let message =
                    crate::data_parallel::model_message(net, values, step, generation, Dtype::F32);
                if let Err(e) = net.send(to, message) {
                    let (rank, why) = lost(e)?;
                    actions.extend(lead.handle_lost(rank, why));
                }
            }
            // What arrives before the answer on its link is the abandoned attempt's (chunks, an
            // older generation's answer).
            LeadAction::Await(from) => match net.recv_from(from, timeout) {
                Ok(Message::Control(control)) => {
                    match AllReduceMessage::from_control(&control, net, from)? {
                        Some(AllReduceMessage::Holding {
                            generation,
                            optimizer_steps,
                        }) => {
                            actions.extend(lead.handle_holding(from, generation, optimizer_steps))
                        }
                        None => {
                            return Err(Error::protocol(
                                "all-reduce",
                                net,
                                from,
                                "message instead of its steps while the ring is re-formed",
                            ));
                        }
                    }
                }
                Ok(Message::Tensor(h, bytes)) if h.tag == TensorTag::ParamGrads => {
                    net.buffers().give(bytes);
                    actions.push_front(LeadAction::Await(from));
                }
                Ok(_) => {
                    return Err(Error::protocol(
                        "all-reduce",
                        net,
                        from,
                        "message instead of its steps while the ring is re-formed",
                    ));
                }
                Err(e) => {
                    let (rank, why) = lost(e)?;
                    actions.extend(lead.handle_lost(rank, why));
                }
            },
            LeadAction::Done => break,
            LeadAction::Fail(why) => return Err(Error::Config(why)),
        }
    }
    *ring = Ring {
        members: lead.members().to_vec(),
        generation: lead.generation(),
    };
    Ok(())
}

/// A worker other than rank 0 waits for rank 0's order to go on (unless it has it already),
/// answers with the steps it has completed, and takes rank 0's state where they differ, carrying
/// out what [`Follow`] decides. Returns the step to run next.
#[allow(clippy::too_many_arguments)]
fn follow_regroup(
    net: &mut dyn Transport,
    rank: u32,
    ring: &mut Ring,
    order: Option<Order>,
    stage: &mut Stage,
    optimizer: &mut Optimizer,
    timeout: Duration,
    notices: &mut Vec<String>,
) -> Result<u64> {
    let mut follow = Follow::new(rank, ring.generation, optimizer.steps());
    let mut actions: VecDeque<FollowAction> = match order {
        Some(order) => follow.handle_order(order).into(),
        None => VecDeque::new(),
    };
    // Chunks of the new ring from workers that heard of it first wait for it here.
    let mut newer: Vec<(u32, Message)> = Vec::new();
    let params = stage.params().len();
    let shapes: Vec<(&'static str, usize)> = optimizer
        .state()
        .iter()
        .map(|(name, v)| (*name, v.len()))
        .collect();
    let expected = params + shapes.iter().map(|s| s.1).sum::<usize>();
    let mut received: Vec<f32> = Vec::new();
    let order = loop {
        let Some(action) = actions.pop_front() else {
            actions.extend(follow.handle_idle());
            continue;
        };
        match action {
            FollowAction::AwaitOrder => match net.recv(timeout) {
                Ok((
                    0,
                    Message::Control(Control::Regroup {
                        generation,
                        members,
                        step,
                        optimizer_steps,
                    }),
                )) => actions.extend(follow.handle_order(Order {
                    generation,
                    members,
                    step,
                    optimizer_steps,
                })),
                // Chunks of the abandoned attempt, and of the new ring.
                Ok((from, Message::Tensor(h, bytes))) if h.tag == TensorTag::ParamGrads => {
                    match follow.handle_chunk(chunk_parts(h.micro_batch).0) {
                        ChunkFate::Drop => net.buffers().give(bytes),
                        ChunkFate::Keep => newer.push((from, Message::Tensor(h, bytes))),
                    }
                }
                Ok((from, _)) => {
                    return Err(Error::protocol(
                        "all-reduce",
                        net,
                        from,
                        "message while the ring is re-formed",
                    ));
                }
                Err(TransportError::Timeout { waited, .. }) => {
                    return Err(TransportError::Timeout {
                        what: "rank 0's order to re-form the ring".into(),
                        from: net.peer_name(0).to_string(),
                        waited,
                    }
                    .into());
                }
                Err(e) => match e.failed_peer() {
                    Some(dead) if dead != 0 => {}
                    _ => return Err(e.into()),
                },
            },
            FollowAction::SendHolding { generation, steps } => {
                net.send(
                    0,
                    AllReduceMessage::Holding {
                        generation,
                        optimizer_steps: steps,
                    }
                    .to_message(),
                )?;
            }
            // The state follows on rank 0's link (or a newer order, if a member died
            // meanwhile); a dead worker's link may report its failure meanwhile, which is old
            // news here.
            FollowAction::AwaitState => match net.recv_from(0, timeout) {
                Ok(Message::Tensor(h, bytes)) if h.tag == TensorTag::Params => {
                    let values = h.elements().unwrap_or(u64::MAX);
                    received.clear();
                    tensor_values(&bytes, h.dtype, &mut received);
                    net.buffers().give(bytes);
                    actions.extend(follow.handle_state(h.micro_batch, values, expected as u64));
                }
                Ok(Message::Control(Control::Regroup {
                    generation,
                    members,
                    step,
                    optimizer_steps,
                })) => actions.extend(follow.handle_order(Order {
                    generation,
                    members,
                    step,
                    optimizer_steps,
                })),
                Ok(_) => {
                    return Err(Error::protocol(
                        "all-reduce",
                        net,
                        0,
                        "message instead of its state",
                    ));
                }
                Err(e) => match e.failed_peer() {
                    Some(dead) if dead != 0 && dead != rank => {
                        actions.push_front(FollowAction::AwaitState);
                    }
                    _ => return Err(e.into()),
                },
            },
            FollowAction::LoadState { optimizer_steps } => {
                // A phantom run (the simulator's sizes-only mode) carries the state's size, not
                // its values.
                if !(received.is_empty() && ringtmp_meter::phantom()) {
                    stage.params_mut().copy_from_slice(&received[..params]);
                    let mut at = params;
                    let tensors: Vec<(&str, Vec<f32>)> = shapes
                        .iter()
                        .map(|(name, len)| {
                            let t = (*name, received[at..at + len].to_vec());
                            at += len;
                            t
                        })
                        .collect();
                    optimizer.load_state(&tensors, optimizer_steps)?;
                }
            }
            FollowAction::Finish(order) => break order,
            FollowAction::Fail(why) => return Err(Error::Config(why)),
        }
    };
    stage.zero_grad();
    for (from, message) in newer.into_iter().rev() {
        net.unread(from, message);
    }
    notices.push(format!(
        "all-reduce: rank {rank}: the ring is now ranks {:?}; continuing from step {}",
        order.members, order.step
    ));
    *ring = Ring {
        members: order.members,
        generation: order.generation,
    };
    Ok(order.step)
}

/// Runs worker `rank` of `job` on `data` until the job's last iteration; rank 0 evaluates,
/// checkpoints and writes the run's outputs. A worker that dies is left behind: the survivors
/// re-form the ring and go on from rank 0's replica (rank 0's death ends the run).
pub fn run_worker(
    job: &AllReduceJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&crate::Event),
) -> Result<WorkerOutcome> {
    let spec = &job.spec;
    let n = job.workers;
    let layers = spec.layers()?;
    let mut stage = spec.initial_stage(
        &layers,
        0..layers.len(),
        spec.threads,
        spec.resume_from.is_some(),
    )?;
    let mut optimizer = Optimizer::new(spec.optimizer.clone(), stage.params().len());
    if let Some(ResumePoint { dir, .. }) = &spec.resume_from {
        let manifest = checkpoint::read_manifest(dir)?;
        checkpoint::read_stage(dir, &manifest, &mut stage, &mut optimizer)?;
    }
    let ranges = buckets(&stage, job.bucket_bytes);
    if ranges.len() >= MAX_BUCKETS {
        return Err(Error::Config(format!(
            "--bucket-mb too small: {} buckets (at most {MAX_BUCKETS})",
            ranges.len()
        )));
    }
    let clock = net.clock();
    let speed = job.node_speeds.get(rank as usize).copied().unwrap_or(1.0);
    let global = spec.batch_size * n;
    let mut plan = BatchPlan::new(data.train.len(), global, spec.seed)?;
    let mut share = crate::data_parallel::ShareBuffers::default();
    let mut recorder = crate::data_parallel::open_recorder(
        spec,
        super::NAME,
        rank,
        stage.params().len(),
        json!({"workers": n, "buckets": ranges.len(), "bucket_bytes": job.bucket_bytes,
                    "params": stage.params().len()}),
        on_event,
    )?;
    let started = clock.now();
    let (mut train_seconds, mut compute_seconds, mut reduce_wait) = (0.0f64, 0.0f64, 0.0f64);
    let (mut samples, mut iterations) = (0u64, 0u64);
    let mut ring = Ring {
        members: (0..n as u32).collect(),
        generation: 0,
    };
    let mut dropped: Vec<DroppedNode> = Vec::new();
    let mut step = spec.first_step();
    while step < spec.total_steps {
        let t_step = clock.now();
        let (t0, wall) = (clock.now(), Instant::now());
        let (at, m) = (ring.position(rank).expect("a member"), ring.members.len());
        let mut local_loss = crate::data_parallel::forward_share(
            spec, &mut plan, data, &mut stage, at as u32, m, step, &mut share,
        )? as f32;
        // Shares differ by a row when the survivors do not divide the global batch: weigh each
        // share's mean by its rows, so the sum over workers divided by m is the batch's mean.
        // (A language model's share has a label per position: its rows are windows.)
        let rows = share.y.len() / spec.positions();
        let weight = (rows * m) as f32 / global as f32;
        if weight != 1.0 {
            share.dlogits.iter_mut().for_each(|d| *d *= weight);
            local_loss *= weight;
        }
        let mut reducer = Reducer::new(
            rank,
            &ring,
            &ranges,
            1,
            step,
            spec.recv_timeout(),
            spec.wire_dtype,
        );
        backward_overlapping(
            job.overlap,
            &mut stage,
            &share.dlogits,
            &mut reducer,
            local_loss,
            net,
        )?;
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t0).as_secs_f64();
        // Whatever the backward did not start yet (the first layers' bucket), then the rest of
        // the reduction.
        let waited = clock.now();
        reducer.start_ready(0, stage.grads(), local_loss, net)?;
        reducer.finish(net)?;
        reduce_wait += (clock.now() - waited).as_secs_f64();
        iterations += 1;
        let reduced = match reducer.close(net) {
            Ok(reduced) => reduced,
            Err(broke) => {
                // The step is abandoned; the survivors go on from rank 0's replica.
                stage.zero_grad();
                let regrouped = Regrouping {
                    rank,
                    step,
                    timeout: spec.recv_timeout(),
                };
                step = regrouped.after(
                    broke,
                    net,
                    &mut ring,
                    &mut stage,
                    &mut optimizer,
                    &mut dropped,
                    recorder.as_mut(),
                    on_event,
                )?;
                train_seconds += (clock.now() - t_step).as_secs_f64();
                continue;
            }
        };
        // The mean of the workers' gradients, then the same step on every replica.
        let step_loss = take_mean(&mut stage, &reduced, m);
        let lr = spec.lr_at(step);
        let (t1, wall) = (clock.now(), Instant::now());
        if let Some(max_norm) = spec.clip_grad_norm {
            // Every replica holds the same averaged gradient: the same norm and factor, the
            // large batch's own clipping.
            crate::clipping::clip_whole(&mut stage, max_norm);
        }
        stage.step(&mut optimizer, lr);
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t1).as_secs_f64();
        train_seconds += (clock.now() - t_step).as_secs_f64();
        samples += global as u64;
        if !step_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: step_loss,
            });
        }
        step += 1;
        let done = step;
        net.step_done();
        let Some(recorder) = recorder.as_mut() else {
            continue;
        };
        recorder.announce_step(done, step_loss, lr, (train_seconds, samples), on_event)?;
        if spec.eval_due(done) {
            let score = crate::evaluation::evaluate(&mut stage, &data.test, data.classes)?;
            recorder.announce_eval(
                done,
                score,
                train_seconds,
                (clock.now() - started).as_secs_f64(),
                on_event,
            )?;
        }
        if spec.checkpoint_due(done) {
            let dir = write_checkpoint(job, &stage, &optimizer, done)?;
            recorder.announce_checkpoint(done, dir, on_event)?;
        }
    }
    // Every worker's measurements, straight to rank 0.
    let own = crate::data_parallel::worker_summary(
        rank,
        &stage,
        &optimizer,
        net,
        &crate::data_parallel::WorkerClock {
            train_seconds,
            compute_seconds,
            wait_seconds: reduce_wait,
            iterations,
        },
    );
    let totals = crate::data_parallel::RunTotals {
        params: stage.params().len() as u64,
        steps: spec.total_steps,
        samples,
        wall_seconds: 0.0,
        train_seconds,
    };
    let summary = report(
        job,
        net,
        rank,
        &ring,
        own,
        recorder,
        (totals, started),
        dropped,
        on_event,
    )?;
    Ok(WorkerOutcome { stage, summary })
}

/// The end of the run: every worker's report goes to rank 0, which writes the run's summary
/// (its wall time since `started`, measured now) and returns it.
#[allow(clippy::too_many_arguments)]
fn report(
    job: &AllReduceJob,
    net: &mut dyn Transport,
    rank: u32,
    ring: &Ring,
    own: ringtmp_metrics::NodeSummary,
    recorder: Option<crate::recorder::RunRecorder>,
    (mut totals, started): (crate::data_parallel::RunTotals, std::time::Duration),
    dropped: Vec<DroppedNode>,
    on_event: &mut dyn FnMut(&crate::Event),
) -> Result<Option<Summary>> {
    let spec = &job.spec;
    let Some(per_node) = crate::data_parallel::gather_reports(
        net,
        rank,
        &ring.members,
        own,
        spec.recv_timeout(),
        on_event,
    )?
    else {
        return Ok(None);
    };
    let Some(recorder) = recorder else {
        unreachable!("rank 0 gathers the reports and holds the recorder")
    };
    totals.wall_seconds = (net.clock().now() - started).as_secs_f64();
    let summary = Summary {
        dropped_nodes: dropped,
        ..crate::data_parallel::run_summary(
            &recorder,
            super::NAME,
            job.workers as u32,
            &totals,
            per_node,
        )
    };
    Ok(Some(recorder.finish(summary)?))
}

/// The backward pass of this worker's share, overlapped (when `overlap`) with the reduction:
/// between layers it starts the buckets whose gradients are complete and moves the ones in
/// flight. A failure is kept until the layer ends (a hook cannot return one).
fn backward_overlapping(
    overlap: bool,
    stage: &mut Stage,
    dlogits: &[f32],
    reducer: &mut Reducer,
    local_loss: f32,
    net: &mut dyn Transport,
) -> Result<()> {
    let mut failure: Option<Error> = None;
    let mut hook = |offset: usize, tail: &[f32]| {
        if failure.is_some() || !overlap {
            return;
        }
        let moved = reducer
            .start_ready(offset, tail, local_loss, net)
            .and_then(|()| reducer.pump(net));
        if let Err(e) = moved {
            failure = Some(e);
        }
    };
    stage.backward_streaming(0, dlogits, &mut hook)?;
    failure.map_or(Ok(()), Err)
}

/// Replaces `stage`'s gradient by the mean of the `m` workers' (the reduced sums, bucket by
/// bucket); returns the mean of their losses (carried after the first bucket's values).
fn take_mean(stage: &mut Stage, reduced: &[Reduced], m: usize) -> f64 {
    if ringtmp_meter::phantom() {
        return 0.0;
    }
    let scale = 1.0 / m as f32;
    let mut step_loss = 0.0f64;
    let grads = stage.grads_mut();
    for (b, (range, sums)) in reduced.iter().enumerate() {
        let len = range.len();
        grads[range.clone()]
            .iter_mut()
            .zip(&sums[..len])
            .for_each(|(g, v)| *g = v * scale);
        if b == 0 {
            step_loss = f64::from(sums[len]) / m as f64;
        }
    }
    step_loss
}

/// A worker's part in re-forming the ring after a step broke (a member died, or rank 0 ordered
/// a regroup): rank 0 leads the survivors; the others follow its order. The step is abandoned
/// and the survivors go on from rank 0's replica.
struct Regrouping {
    rank: u32,
    /// The step that broke.
    step: u64,
    timeout: std::time::Duration,
}

impl Regrouping {
    /// Re-forms `ring` after `broke`; returns the step to go on from.
    #[allow(clippy::too_many_arguments)]
    fn after(
        &self,
        broke: Break,
        net: &mut dyn Transport,
        ring: &mut Ring,
        stage: &mut Stage,
        optimizer: &mut Optimizer,
        dropped: &mut Vec<DroppedNode>,
        recorder: Option<&mut crate::recorder::RunRecorder>,
        on_event: &mut dyn FnMut(&crate::Event),
    ) -> Result<u64> {
        let mut notices: Vec<String> = Vec::new();
        let step = match broke {
            Break::Lost { rank: dead, reason } if self.rank == 0 => {
                reform_ring(
                    net,
                    ring,
                    dead,
                    reason,
                    self.step,
                    stage,
                    optimizer,
                    dropped,
                    self.timeout,
                    &mut notices,
                )?;
                if let Some(recorder) = recorder {
                    recorder.write(json!({"event": "dropped", "rank": dead,
                        "step": self.step, "members": ring.members}))?;
                }
                self.step
            }
            Break::Lost { .. } => follow_regroup(
                net,
                self.rank,
                ring,
                None,
                stage,
                optimizer,
                self.timeout,
                &mut notices,
            )?,
            Break::Regroup(order) => follow_regroup(
                net,
                self.rank,
                ring,
                Some(order),
                stage,
                optimizer,
                self.timeout,
                &mut notices,
            )?,
        };
        for text in notices {
            on_event(&crate::Event::Notice { text });
        }
        Ok(step)
    }
}

/// Rank 0 writes the one model every replica holds, in the format every strategy reads.
fn write_checkpoint(
    job: &AllReduceJob,
    stage: &Stage,
    optimizer: &Optimizer,
    step: u64,
) -> Result<std::path::PathBuf> {
    write_model(
        &job.spec,
        job.workers,
        super::NAME,
        stage,
        optimizer,
        step,
        &[],
    )
}
