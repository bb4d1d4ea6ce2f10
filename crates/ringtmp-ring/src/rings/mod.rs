//! Rings of rings (`--strategy ring --replicas R`): R rings of S nodes train side by side, as
//! PipeDream and Megatron combine pipeline and data parallelism. Physical rank `r·S + s` is stage
//! `s` of ring `r`; ring `r`'s master (`r·S`) holds the data and labels of its share of every
//! global batch (R × the batch), and the copies of a stage in the R rings — its *group* — average
//! their gradients before every step with a ring all-reduce among themselves, so every ring's
//! stage steps with the same mean and the rings stay identical: with a synchronous schedule, R
//! rings of batch b compute what one ring (or one process) of batch R·b does.
//!
//! The ring code runs unchanged on [`RingsView`], which numbers its ring's nodes 0…S−1 and does
//! the group's all-reduce in [`crate::net::RingNet::average_with_replicas`]. Messages of the group that
//! arrive while the ring is being served (a faster copy already reducing) wait in the view for
//! the all-reduce, and the ring's messages that arrive during an all-reduce stay with the
//! underlying transport for the ring; nothing is dropped.
//!
//! With stage replicas (`--stage-replicas`, rings that train on their own between
//! synchronisations: `--replica-sync every:K` or `diloco:H`), a ring heals around a dead node as
//! one ring does (`crate::heal`, on this view), and the other rings go on: its master tells
//! them who holds the dead node's layers now (`holders`), and the copies of each stage
//! synchronise with that holder, stage by stage (a node holding two stages takes part in both
//! groups). A replication round follows every synchronisation, so a healed ring goes back no
//! further than the last one; the failures of other rings' nodes are theirs to heal.

mod exchange;
mod gossip;
mod group;
mod holders;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ringtmp_transport::{Clock, LinkStats, PeerName, Transport, TransportError};
use ringtmp_wire::Message;

use crate::net::RingNet;
use gossip::ReplicaGossip;
use holders::Holders;
use ringtmp_collective::outer::{OuterConfig, OuterState};

/// Ring `ring` of `rings`, `stages` nodes each, over a node's transport.
pub struct RingsView<'a> {
    inner: &'a mut dyn Transport,
    ring: u32,
    stages: u32,
    rings: u32,
    /// Group tensors received while the ring was being served.
    group_inbox: VecDeque<(u32, Message)>,
    /// How long an all-reduce waits for a copy.
    timeout: Duration,
    /// `--replica-sync adpsgd`: this copy's side of its group's gossip.
    gossip: Option<ReplicaGossip>,
    /// `--replica-sync diloco:H`: the outer optimizer and the outer state of each stage this
    /// node holds (the same bits in every copy of it).
    outer: Option<(OuterConfig, BTreeMap<u32, OuterState>)>,
    /// Under `diloco:H`: the mean inner learning rate of the H mini-batches up to and including
    /// a mini-batch, as a fraction of the peak (the outer step's `rate`).
    outer_rate: Option<Box<dyn Fn(u64) -> f32 + Send + 'a>>,
    /// Who holds each stage in every ring.
    holders: Holders,
    /// Parameters of each stage as the rings started (empty: this node's values are one
    /// stage's, whatever their length).
    unit_sizes: Vec<usize>,
    /// Stage replicas: rings heal, and the failures of other rings' nodes are theirs.
    elastic: bool,
    /// Other rings' nodes seen to fail.
    dead: BTreeSet<u32>,
}

impl<'a> RingsView<'a> {
    /// The view of physical rank `inner.rank()` in rings of `stages` nodes, `rings` of them.
    pub fn new(inner: &'a mut dyn Transport, stages: u32, rings: u32, timeout: Duration) -> Self {
        let ring = inner.rank() / stages;
        Self {
            inner,
            ring,
            stages,
            rings,
            group_inbox: VecDeque::new(),
            timeout,
            gossip: None,
            outer: None,
            outer_rate: None,
            holders: Holders::new(rings, stages),
            unit_sizes: Vec::new(),
            elastic: false,
            dead: BTreeSet::new(),
        }
    }

    /// Rings heal around their dead nodes (`--stage-replicas`); `unit_sizes` are the stages'
    /// parameter counts as the rings started.
    pub fn with_stage_replicas(mut self, unit_sizes: Vec<usize>) -> Self {
        self.unit_sizes = unit_sizes;
        self.elastic = true;
        self
    }

    /// The copies of this node's stage synchronise like DiLoCo (`--replica-sync diloco:H`):
    /// each average is of pseudo-gradients, taken through `config`'s outer step; `start` is the
    /// stage's parameters before training (every copy's); `rate` gives the outer step's rate for
    /// the synchronisation after a mini-batch (see [`OuterState::step`]).
    pub fn with_outer(
        mut self,
        config: OuterConfig,
        start: &[f32],
        rate: Box<dyn Fn(u64) -> f32 + Send + 'a>,
    ) -> Self {
        self.outer_rate = Some(rate);
        let state = if ringtmp_meter::phantom() {
            OuterState::default()
        } else {
            OuterState::new(start)
        };
        let stage = self.inner.rank() % self.stages;
        self.outer = Some((config, BTreeMap::from([(stage, state)])));
        self
    }

    /// The copies of this node's stage gossip (`--replica-sync adpsgd`) instead of averaging on
    /// a schedule; `seed` makes the partners replay.
    pub fn with_gossip(mut self, seed: u64, every: u64) -> Self {
        let rank = self.inner.rank();
        self.gossip = Some(ReplicaGossip::new(
            self.ring,
            self.rings,
            rank % self.stages,
            self.stages,
            seed,
            every,
        ));
        self
    }

    fn physical(&self, k: u32) -> u32 {
        self.ring * self.stages + k
    }

    /// The stages this node holds, with the range of each in its values (`len` of them).
    fn held(&self, len: usize) -> Result<Vec<(u32, std::ops::Range<usize>)>, TransportError> {
        let units = self
            .holders
            .units(self.ring, self.inner.rank() % self.stages);
        if units.len() == 1 && self.unit_sizes.is_empty() {
            return Ok(vec![(units.start, 0..len)]);
        }
        let mut at = 0;
        let mut held = Vec::new();
        for u in units.clone() {
            let size = self.unit_sizes.get(u as usize).copied().unwrap_or(0);
            held.push((u, at..at + size));
            at += size;
        }
        if at == len {
            return Ok(held);
        }
        // A sizes-only run's values may stand for one stage whatever their length.
        if units.len() == 1 && ringtmp_meter::phantom() {
            return Ok(vec![(units.start, 0..len)]);
        }
        Err(TransportError::Io {
            context: format!(
                "rings of rings: {len} values on a node holding stages {units:?} of {at} \
                 parameters"
            ),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "the stage changed size"),
        })
    }

    /// Takes the other rings' announcements of a heal out of the group inbox; whether the
    /// tables changed.
    fn take_announcements(&mut self) -> bool {
        let mut changed = false;
        let stages = self.stages;
        let ring = self.ring;
        let mut kept = VecDeque::with_capacity(self.group_inbox.len());
        for (from, message) in self.group_inbox.drain(..) {
            match message {
                Message::Control(ringtmp_wire::Control::Regroup {
                    generation,
                    members,
                    ..
                }) if from % stages == 0 && from / stages != ring => {
                    changed |= self.holders.regrouped(from / stages, generation, &members);
                }
                other => kept.push_back((from, other)),
            }
        }
        self.group_inbox = kept;
        changed
    }

    /// A failure that `e` reports, as this ring's view gives it: a node of this ring by its
    /// rank in the ring; another ring's node, under stage replicas, noted and not an error
    /// here (`None`: that ring heals, and its master says who holds the node's layers); nor is
    /// a node this ring healed around already (its links report their end more than once: the
    /// reader, then a writer's failed send, which may come while the copies synchronise).
    fn absorb(&mut self, e: TransportError) -> Option<TransportError> {
        let Some(p) = e.failed_peer() else {
            return Some(e);
        };
        if !self.elastic {
            return Some(e);
        }
        if self.in_ring(p) {
            if !self.holders.is_member(self.ring, p % self.stages) {
                return None;
            }
            return Some(renumbered(e, p % self.stages));
        }
        self.dead.insert(p);
        None
    }

    /// Whether physical `p` is in this node's ring.
    fn in_ring(&self, p: u32) -> bool {
        p / self.stages == self.ring
    }
}

impl Transport for RingsView<'_> {
    fn rank(&self) -> u32 {
        self.inner.rank() % self.stages
    }

    fn peers(&self) -> Vec<u32> {
        let me = self.rank();
        (0..self.stages).filter(|k| *k != me).collect()
    }

    fn peer_name(&self, rank: u32) -> PeerName {
        self.inner.peer_name(self.physical(rank))
    }

    fn send(&self, to: u32, message: Message) -> Result<(), TransportError> {
        let p = self.physical(to);
        self.inner.send(p, message).map_err(|e| {
            if self.elastic && e.failed_peer() == Some(p) {
                renumbered(e, to)
            } else {
                e
            }
        })
    }

    fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError> {
        let clock = self.inner.clock();
        let deadline = clock.now() + wait;
        loop {
            let left = deadline.saturating_sub(clock.now());
            let (from, message) = match self.inner.recv(left) {
                Ok(x) => x,
                Err(e) => match self.absorb(e) {
                    None => continue,
                    Some(e) => return Err(e),
                },
            };
            if self.in_ring(from) {
                return Ok((from % self.stages, message));
            }
            self.group_inbox.push_back((from, message));
        }
    }

    fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError> {
        loop {
            let next = match self.inner.try_recv() {
                Ok(next) => next,
                Err(e) => match self.absorb(e) {
                    None => continue,
                    Some(e) => return Err(e),
                },
            };
            match next {
                None => return Ok(None),
                Some((from, message)) if self.in_ring(from) => {
                    return Ok(Some((from % self.stages, message)));
                }
                Some((from, message)) => self.group_inbox.push_back((from, message)),
            }
        }
    }

    fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError> {
        let p = self.physical(from);
        let clock = self.inner.clock();
        let deadline = clock.now() + wait;
        loop {
            let left = deadline.saturating_sub(clock.now());
            match self.inner.recv_from(p, left) {
                Ok(message) => return Ok(message),
                Err(e) => match self.absorb(e) {
                    None => continue,
                    Some(e) => return Err(e),
                },
            }
        }
    }

    fn unread(&mut self, from: u32, message: Message) {
        let p = self.physical(from);
        self.inner.unread(p, message);
    }

    fn buffers(&self) -> &ringtmp_transport::BufferPool {
        self.inner.buffers()
    }

    fn stats(&self) -> Vec<LinkStats> {
        self.inner.stats()
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    fn close(&mut self) -> Result<(), TransportError> {
        self.inner.close()
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.inner.clock()
    }

    fn watch_steps(&mut self, bound: ringtmp_transport::StepBound) {
        self.inner.watch_steps(bound)
    }

    fn step_done(&mut self) {
        self.inner.step_done()
    }
}

impl RingNet for RingsView<'_> {
    /// Rings of rings: the mean of `values` over the copies of this stage; under
    /// `--replica-sync diloco:H`, one outer step of the mean pseudo-gradient, after which
    /// `values` are the new outer parameters. A node holding several stages (a healed ring's)
    /// does so for each.
    fn average_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
    ) -> Result<(), TransportError> {
        let Some((config, mut states)) = self.outer.take() else {
            return self.mean_over_copies(step, values);
        };
        let result = (|| {
            if ringtmp_meter::phantom() {
                return self.mean_over_copies(step, values);
            }
            for (unit, range) in self.held(values.len())? {
                let Some(state) = states.get_mut(&unit) else {
                    return Err(TransportError::Io {
                        context: format!("rings of rings: no DiLoCo outer state of stage {unit}"),
                        source: std::io::Error::new(
                            std::io::ErrorKind::InvalidInput,
                            "the stage's layers came without their outer momentum",
                        ),
                    });
                };
                let own = &mut values[range];
                if state.global.len() != own.len() {
                    return Err(TransportError::Io {
                        context: format!(
                            "rings of rings: a DiLoCo outer step of {} parameters on a stage of {}",
                            own.len(),
                            state.global.len()
                        ),
                        source: std::io::Error::new(
                            std::io::ErrorKind::InvalidInput,
                            "the stage changed size",
                        ),
                    });
                }
                let mut delta: Vec<f32> = state
                    .global
                    .iter()
                    .zip(own.iter())
                    .map(|(outer, own)| outer - own)
                    .collect();
                self.unit_mean(step, unit, &mut delta)?;
                let rate = self.outer_rate.as_ref().map_or(1.0, |rate| rate(step));
                state.step(&config, 0..delta.len(), &delta, rate);
                state.updates += 1;
                own.copy_from_slice(&state.global);
            }
            Ok(())
        })();
        self.outer = Some((config, states));
        result
    }

    /// Stage replicas: this ring re-formed; the ring's master tells every node of the other
    /// rings (best effort: a node that died is its own ring's to heal).
    fn ring_regrouped(&mut self, generation: u64, members: &[u32]) -> Result<(), TransportError> {
        self.holders.regrouped(self.ring, generation, members);
        if !self.inner.rank().is_multiple_of(self.stages) {
            return Ok(());
        }
        for p in 0..self.rings * self.stages {
            if self.in_ring(p) || self.dead.contains(&p) {
                continue;
            }
            let notice = Message::Control(ringtmp_wire::Control::Regroup {
                generation,
                members: members.to_vec(),
                step: 0,
                optimizer_steps: 0,
            });
            if let Err(e) = self.inner.send(p, notice)
                && let Some(e) = self.absorb(e)
            {
                return Err(e);
            }
        }
        Ok(())
    }

    /// The outer momentum of the stages this node holds, in their order (they are its
    /// values' order).
    fn replica_outer_state(&self) -> Vec<f32> {
        let Some((_, states)) = &self.outer else {
            return Vec::new();
        };
        let units = self
            .holders
            .units(self.ring, self.inner.rank() % self.stages);
        let mut velocity = Vec::new();
        for u in units {
            match states.get(&u) {
                Some(state) => velocity.extend_from_slice(&state.velocity),
                // Without every stage's, a replica carries none (a heal from it refuses).
                None => return Vec::new(),
            }
        }
        velocity
    }

    /// After a heal: each stage this node holds gets its outer state from the restored
    /// snapshot, taken right after an outer step (its outer parameters are the snapshot's).
    fn restore_outer_state(
        &mut self,
        params: &[f32],
        velocity: &[f32],
    ) -> Result<(), TransportError> {
        if self.outer.is_none() || ringtmp_meter::phantom() {
            return Ok(());
        }
        let held = self.held(params.len())?;
        let Some((_, states)) = &mut self.outer else {
            return Ok(());
        };
        if velocity.len() != params.len() {
            return Err(TransportError::Io {
                context: format!(
                    "rings of rings: a restored stage of {} parameters with {} values of \
                     outer momentum",
                    params.len(),
                    velocity.len()
                ),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the replica lacks its outer state",
                ),
            });
        }
        let updates = states.values().map(|s| s.updates).max().unwrap_or(0);
        states.clear();
        for (unit, range) in held {
            states.insert(
                unit,
                OuterState {
                    global: params[range.clone()].to_vec(),
                    velocity: velocity[range].to_vec(),
                    updates,
                    replaced: false,
                },
            );
        }
        Ok(())
    }

    fn gossip_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
        last: bool,
    ) -> Result<(), TransportError> {
        let Some(mut gossip) = self.gossip.take() else {
            return Ok(());
        };
        let result = self.gossip_round(&mut gossip, step, values, last);
        self.gossip = Some(gossip);
        result?;
        if last {
            // One model from the rings: the copies average once, exactly.
            self.mean_over_copies(step, values)?;
        }
        Ok(())
    }
}

/// `e`, naming failed peer `rank` (this ring's number for it) instead.
fn renumbered(e: TransportError, rank: u32) -> TransportError {
    match e {
        TransportError::WhileWaiting { waiting_for, cause } => TransportError::WhileWaiting {
            waiting_for,
            cause: Box::new(renumbered(*cause, rank)),
        },
        TransportError::PeerClosed { mut peer, reason } => {
            peer.rank = Some(rank);
            TransportError::PeerClosed { peer, reason }
        }
        TransportError::PeerSilent {
            mut peer,
            silent_for,
        } => {
            peer.rank = Some(rank);
            TransportError::PeerSilent { peer, silent_for }
        }
        other => other,
    }
}

fn group_error(view: &RingsView<'_>, from: u32, what: &str) -> TransportError {
    TransportError::Io {
        context: format!("rings of rings: {what} from {}", view.inner.peer_name(from)),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not part of the protocol"),
    }
}

/// Runs physical rank `rank` of rings of rings: its stage in its ring; every ring's master but
/// the first writes its own records under `rings/ring-R/` of the output directory and sends its
/// summary to the first, whose summary covers every ring and node.
pub fn run(
    job: &crate::run::driver::RingJob,
    rank: u32,
    cx: &mut ringtmp_contract::contract::NodeCx<'_>,
) -> ringtmp_contract::Result<Option<ringtmp_metrics::Summary>> {
    use ringtmp_wire::Control;
    let stages = job.partition.len() as u32;
    let rings = job.replicas as u32;
    let (ring, stage) = (rank / stages, rank % stages);
    let mut job = job.clone();
    job.ring = ring as usize;
    if ring > 0 {
        job.spec.config.out = job.spec.out.join("rings").join(format!("ring-{ring}"));
        job.spec.config.checkpoint_every = 0;
    }
    let timeout = job.recv_timeout();
    let data = if stage == 0 { Some(cx.data()?) } else { None };
    let mut view = RingsView::new(&mut *cx.net, stages, rings, timeout);
    if job.gossip_every > 0 {
        view = view.with_gossip(job.spec.seed, job.gossip_every);
    }
    if let Some(outer) = job.outer_sync {
        // Every copy starts from the same parameters (the seed's, `--init-from`'s or the
        // resumed checkpoint's): the outer parameters before the first outer step.
        let (mut start, _) = job.stage_unconfigured(stage)?;
        if job.spec.resume_from.is_some() {
            let mut optimizer =
                ringtmp_model::Optimizer::new(job.spec.optimizer.clone(), start.params().len());
            job.load(&mut start, &mut optimizer)?;
        }
        // The synchronisation after mini-batch `step` follows `step + 1` complete ones.
        let (spec, every) = (job.spec.clone(), job.average_every);
        let rate = move |step: u64| spec.rate_before(step + 1, every);
        view = view.with_outer(outer, start.params(), Box::new(rate));
    }
    let mut quiet = |_: &ringtmp_contract::Event| {};
    let on_event: &mut dyn FnMut(&ringtmp_contract::Event) =
        if ring == 0 { cx.on_event } else { &mut quiet };
    let summary = if job.replica_every > 0 {
        // Each ring heals around its own dead, on this view.
        let layers = job.layers()?;
        let sizes = job
            .partition
            .iter()
            .map(|p| layers[p.start..p.end].iter().map(|l| l.param_count()).sum())
            .collect();
        view = view.with_stage_replicas(sizes);
        let mut ring_cx = crate::net::RingCx {
            net: &mut view,
            data,
            on_event,
        };
        match crate::heal::run(&job, stage, &mut ring_cx)? {
            Some(summary) => summary,
            None => return Ok(None),
        }
    } else if stage != 0 {
        crate::run::driver::run_worker(&job, &mut view)?;
        return Ok(None);
    } else {
        let setup = crate::run::driver::MasterSetup {
            data: data.ok_or_else(|| {
                ringtmp_contract::Error::Config("a ring's master needs the dataset".into())
            })?,
        };
        crate::run::driver::run_master(&job, &setup, &mut view, on_event)?.summary
    };
    drop(view);
    if ring > 0 {
        let text = serde_json::to_string(&summary).map_err(|e| {
            ringtmp_contract::Error::Config(format!("encoding the ring's summary: {e}"))
        })?;
        cx.net.send(
            0,
            ringtmp_wire::Message::Control(Control::Report { nodes: vec![text] }),
        )?;
        return Ok(None);
    }
    // The first ring's master: every ring's figures in one summary.
    let mut total = summary;
    let mut training_bytes = total.bytes_per_sample * total.samples as f64;
    for r in 1..rings {
        let report = loop {
            match cx.net.recv_from(r * stages, timeout)? {
                // A heal's announcement that nothing waited for any more.
                ringtmp_wire::Message::Control(Control::Regroup { .. }) => {}
                message => break message,
            }
        };
        let report = match report {
            ringtmp_wire::Message::Control(Control::Report { nodes }) if nodes.len() == 1 => {
                serde_json::from_str::<ringtmp_metrics::Summary>(&nodes[0]).map_err(|e| {
                    ringtmp_contract::Error::Config(format!("ring {r}'s summary is not valid: {e}"))
                })?
            }
            _ => {
                return Err(ringtmp_contract::Error::protocol(
                    "rings of rings",
                    &*cx.net,
                    r * stages,
                    "message instead of its ring's summary",
                ));
            }
        };
        training_bytes += report.bytes_per_sample * report.samples as f64;
        total.samples += report.samples;
        total.total_bytes_sent += report.total_bytes_sent;
        total
            .per_node
            .extend(report.per_node.into_iter().map(|mut n| {
                n.rank += r * stages;
                n
            }));
        // A ring's heal names its nodes by their place in it.
        let within = |reason: String| {
            format!(
                "in ring {r}, whose node k is rank {} + k: {reason}",
                r * stages
            )
        };
        total
            .dropped_nodes
            .extend(report.dropped_nodes.into_iter().map(|mut d| {
                d.rank += r * stages;
                d.reason = within(d.reason);
                d
            }));
        total.heals.extend(report.heals.into_iter().map(|mut h| {
            h.rank += r * stages;
            h.reason = within(h.reason);
            h
        }));
    }
    total.nodes = stages * rings;
    total.samples_per_second = total.samples as f64 / total.train_seconds.max(1e-9);
    total.bytes_per_sample = training_bytes / total.samples.max(1) as f64;
    let path = job.spec.out.join("summary.json");
    let text = serde_json::to_string_pretty(&total)
        .map_err(|e| ringtmp_contract::Error::Config(format!("encoding the summary: {e}")))?;
    ringtmp_model::checkpoint::write_atomic(&path, text.as_bytes())?;
    Ok(Some(total))
}
