//! The reduction of one iteration's buffers among the members of a ring: buckets, each
//! all-reduced by the plan of [`super::ring`] over the transport, started as their values are
//! complete (during a backward pass, or at once) and moved along as chunks arrive. All-reduce
//! SGD reduces gradients with it; DiLoCo its pseudo-gradients.
//!
//! Invariants: every chunk is summed in the plan's fixed order, so the result is reproducible
//! and every member holds the same bits; chunks carry the ring's generation, so none from an
//! abandoned attempt is ever summed; bucket 0 carries `extra` values after its own (a step's
//! loss); every wait has the job's timeout and names the peer; a member's death breaks the
//! reduction ([`Break`]) instead of ending the run.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use ringtmp_model::Stage;
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::{tensor_bytes_into, tensor_values_into, tensor_view};
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};

use super::regroup::Order;
use super::ring::{RingPlan, chunks};
use ringtmp_contract::error::{Error, Result};

/// Bucket size when the user gives none: PyTorch DDP's. On `mlp` (4 workers, 2 cores) buckets of 1
/// to 64 MB ran within the noise of each other, and every one of them faster than no overlap
/// (docs/BENCHMARKS.md); larger models need buckets for the overlap to pay.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

/// One bucket: a contiguous range of the flat gradient buffer reduced as one all-reduce.
pub struct Bucket {
    /// The gradients it covers.
    range: Range<usize>,
    /// Its values while it is reduced (bucket 0 carries the step's loss in one more slot).
    values: Vec<f32>,
    /// Its chunks.
    chunks: Vec<Range<usize>>,
    /// The next protocol step (`None` until the bucket's gradients are complete).
    step: Option<usize>,
    /// Chunks that arrived before this worker got there, by protocol step: their payloads as
    /// they came (combined straight from these bytes, then given back to the transport's pool).
    early: BTreeMap<usize, (Dtype, Vec<u8>)>,
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
pub enum Break {
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
pub struct Ring {
    /// The live workers' ranks, in ring order.
    pub members: Vec<u32>,
    /// How many times the ring has been re-formed.
    pub generation: u64,
}

impl Ring {
    /// The first ring of a run: every one of `workers`, in rank order.
    pub fn of(workers: usize) -> Self {
        Self {
            members: (0..workers as u32).collect(),
            generation: 0,
        }
    }

    /// Where `rank` is on the ring (`None`: it has left).
    pub fn position(&self, rank: u32) -> Option<usize> {
        self.members.iter().position(|r| *r == rank)
    }
}

/// A reduced bucket: the gradients it covers and their sums (bucket 0 also the loss's).
pub type Reduced = (Range<usize>, Vec<f32>);

/// The reduction of one iteration's gradients.
pub struct Reducer {
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
    /// Decoded values of a chunk whose wire type is not read in place (reused).
    scratch: Vec<f32>,
    /// What chunks travel as.
    wire: Dtype,
}

/// `micro_batch` of a chunk message: the ring's generation, its bucket and protocol step.
pub fn chunk_id(generation: u64, bucket: usize, step: usize) -> u64 {
    (generation << 48) | ((bucket as u64) << 32) | step as u64
}

/// A chunk id's generation, bucket and protocol step.
pub fn chunk_parts(id: u64) -> (u64, usize, usize) {
    (
        id >> 48,
        ((id >> 32) & 0xffff) as usize,
        (id & 0xffff_ffff) as usize,
    )
}

/// Most buckets a reduction may have (the width of the bucket field of a chunk id).
pub const MAX_BUCKETS: usize = 1 << 16;

impl Reducer {
    /// The reduction of `ranges` (buckets) among the members of `ring`, of which `rank` is one;
    /// bucket 0 carries `extra` more values (the step's loss).
    pub fn new(
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
            scratch: Vec::new(),
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
    pub fn start_ready(
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
        self.transmit(b, s, range.len(), payload, net)
    }

    /// Sends `payload`, the `len` values of bucket `b`'s chunk for protocol step `s`.
    fn transmit(
        &mut self,
        b: usize,
        s: usize,
        len: usize,
        payload: Vec<u8>,
        net: &mut dyn Transport,
    ) -> Result<()> {
        let header = TensorHeader {
            run_id: 0,
            step: self.iteration,
            micro_batch: chunk_id(self.generation, b, s),
            tag: TensorTag::ParamGrads,
            dtype: self.wire,
            shape: vec![len as u32],
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
            let Some((dtype, mut bytes)) = bucket.early.remove(&s) else {
                return Ok(());
            };
            // A phantom run's chunks (sizes only, `ringtmp_meter`) carry no values to combine.
            let elided = bytes.is_empty() && ringtmp_meter::phantom();
            let range = bucket.chunks[self.plan.recv_chunk(s)].clone();
            let count = dtype.elements_in(bytes.len());
            if count != range.len() && !elided {
                return Err(Error::protocol(
                    "all-reduce",
                    net,
                    self.pred,
                    &format!("a chunk of {count} values where {} were due", range.len()),
                ));
            }
            // The chunk received at step s is the one sent at step s + 1 (see `ring`). Except after
            // the last reduce-scatter step, whose sum this worker keeps, an f32 chunk goes on in
            // the buffer it came in: a partial sum with this worker's values added there (t + v
            // and v + t are the same bits), a complete chunk as it is.
            let forwards = s + 1 < self.plan.steps() && s + 1 != self.plan.n - 1;
            if forwards
                && !elided
                && dtype == Dtype::F32
                && self.wire == Dtype::F32
                && let Some(values) = ringtmp_wire::message::f32_payload_mut(&mut bytes)
            {
                let target = &mut bucket.values[range.clone()];
                if self.plan.adds(s) {
                    values.iter_mut().zip(&*target).for_each(|(v, t)| *v += t);
                } else {
                    target.copy_from_slice(values);
                }
                bucket.step = Some(s + 1);
                self.transmit(b, s + 1, range.len(), bytes, net)?;
                continue;
            }
            if !elided {
                // Little-endian f32 is read in place; other wire types are decoded once.
                let values = tensor_view(&bytes, dtype, &mut self.scratch);
                let target = &mut bucket.values[range];
                if self.plan.adds(s) {
                    target.iter_mut().zip(values).for_each(|(t, v)| *t += v);
                } else {
                    target.copy_from_slice(values);
                }
            }
            net.buffers().give(bytes);
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
                if from == self.pred && h.step > self.iteration {
                    // The next reduction's, from a predecessor that finished this one (DiLoCo
                    // moves a landed round along until it is applied): it waits for that one.
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
                self.buckets[b].early.insert(s, (h.dtype, bytes));
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
    pub fn pump(&mut self, net: &mut dyn Transport) -> Result<()> {
        while self.broken.is_none() {
            match net.try_recv() {
                Ok(Some((from, message))) => self.take(from, message, net)?,
                Ok(None) => return Ok(()),
                Err(e) => self.failed(e)?,
            }
        }
        Ok(())
    }

    /// Whether the reduction has ended: finished, or broken by a lost member.
    pub fn done(&self) -> bool {
        self.broken.is_some()
            || self
                .buckets
                .iter()
                .all(|b| b.step == Some(self.plan.steps()))
    }

    /// Waits until every bucket is reduced or the ring breaks. Any peer may speak (rank 0 to
    /// re-form the ring; a failure on any link is news), but only the predecessor's silence is
    /// an error, named.
    pub fn finish(&mut self, net: &mut dyn Transport) -> Result<()> {
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
    pub fn close(self, net: &mut dyn Transport) -> std::result::Result<Vec<Reduced>, Break> {
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
