//! The ring heals around a dead node without a restart or a checkpoint, from the stage replicas
//! of [`crate::heal::replicas`] (`--stage-replicas K`).
//!
//! When a non-master node `j` dies, the master (linked to every node, as they all are to each
//! other under this option) picks the last complete round `s`, drops `j` and gives its layers to
//! its predecessor, and sends `Regroup { generation, members, step: s }` to every survivor. Every
//! survivor goes back to its own snapshot of step `s` (the predecessor adds `j`'s replica to its
//! stage), says `Rejoined` to every other survivor, and the ring runs again from mini-batch `s`
//! on the survivors, numbered anew ([`Members`]). The steps after `s` are trained again: with a
//! synchronous schedule the healed run computes exactly what an unbroken one does.
//!
//! Invariants: a node never mixes generations (everything a peer sent before its `Rejoined`, or
//! the master before its `Regroup`, is dropped); a heal uses a round that every survivor
//! completed; the master's death still ends the run (it holds the data), as does a second death
//! before the next round has refreshed the replicas it would need.

pub mod policy;
pub mod replicas;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ringtmp_metrics::{DroppedNode, Restart, Summary};
use ringtmp_transport::{Clock, LinkStats, PeerName, Transport, TransportError};
use ringtmp_wire::{Control, Message};

use crate::heal::replicas::{Replicas, Snapshot};
use crate::net::RingNet;
use crate::plan::partition::StagePlan;
use crate::run::driver::{MasterSetup, RingJob, run_master_with, run_worker_with};
use crate::run::messages::RingMessage;
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;

/// The job of the ring after `dead` (physical ranks, in `members` order) left: its layers go to
/// its predecessor in the ring, which must hold its replica; stages are renumbered in ring order.
pub fn without(job: &RingJob, members: &[u32], dead: u32) -> Result<(RingJob, Vec<u32>)> {
    let index = members
        .iter()
        .position(|m| *m == dead)
        .ok_or_else(|| Error::Config(format!("rank {dead} is not in the ring")))?;
    if index == 0 {
        return Err(Error::Config("the master cannot be healed around".into()));
    }
    let mut partition: Vec<StagePlan> = job.partition.clone();
    let gone = partition.remove(index);
    let pred = &mut partition[index - 1];
    pred.end = gone.end;
    pred.predicted_seconds += gone.predicted_seconds;
    pred.predicted_bytes += gone.predicted_bytes;
    for (r, p) in partition.iter_mut().enumerate() {
        p.rank = r as u32;
    }
    let mut speeds = job.node_speeds.clone();
    speeds.remove(index);
    let survivors: Vec<u32> = members.iter().copied().filter(|m| *m != dead).collect();
    Ok((
        RingJob {
            partition,
            node_speeds: speeds,
            ..job.clone()
        },
        survivors,
    ))
}

/// A node's transport seen as a ring of `members` (physical ranks in ring order): rank `k` is
/// `members[k]`. Messages from a peer are dropped until that peer's marker of this generation
/// arrives (`Rejoined`, or the master's `Regroup`), so nothing of an earlier generation leaks in;
/// messages from non-members are dropped.
pub struct Members<'a> {
    inner: &'a mut dyn RingNet,
    members: Vec<u32>,
    logical: BTreeMap<u32, u32>,
    generation: u64,
    /// Peers whose marker has arrived (generation 0 needs none).
    ready: BTreeSet<u32>,
    /// Messages put back by `unread`, by logical sender.
    unread: VecDeque<(u32, Message)>,
    /// What arrived early of a later generation.
    early: Early,
}

/// What a survivor that heard of a re-formation first sends the others while they still run
/// the old ring (or wait for the master's word): its marker of the new generation, then the new
/// ring's messages (they travel on other links than the master's `Regroup`, so they may overtake
/// it). The next view needs both, in order.
#[derive(Debug, Default)]
pub struct Early {
    /// The marker's generation, by physical peer.
    markers: BTreeMap<u32, u64>,
    /// Messages from those peers after their marker, in arrival order (physical senders).
    held: Vec<(u32, Message)>,
}

impl Early {
    /// Takes what `from` sent when it belongs to a generation later than `generation` (a
    /// marker, or anything after one), which the current ring must not see; gives anything else
    /// back.
    fn keep(&mut self, generation: u64, from: u32, message: Message) -> Option<Message> {
        match (RingMessage::peek(&message), message) {
            (Some(RingMessage::Rejoined { generation: g }), _) if g > generation => {
                self.markers.insert(from, g);
                None
            }
            (_, message) if self.markers.contains_key(&from) => {
                self.held.push((from, message));
                None
            }
            (_, message) => Some(message),
        }
    }

    /// The peers whose marker of `generation` arrived; their held messages go back into `net`
    /// (to be received again, in order), those of other generations are dropped.
    fn release(self, generation: u64, net: &mut dyn RingNet) -> BTreeSet<u32> {
        let ready: BTreeSet<u32> = self
            .markers
            .iter()
            .filter(|&(_, g)| *g == generation)
            .map(|(p, _)| *p)
            .collect();
        for (from, message) in self.held.into_iter().rev() {
            if ready.contains(&from) {
                net.unread(from, message);
            }
        }
        ready
    }
}

impl<'a> Members<'a> {
    /// The ring of every node, as started (generation 0: no markers).
    pub fn all(inner: &'a mut dyn RingNet, world: u32) -> Self {
        let members: Vec<u32> = (0..world).collect();
        let ready = members.iter().copied().collect();
        Self::build(inner, members, 0, ready)
    }

    /// The ring of `members` in `generation`; `ready` peers need no marker.
    pub fn regrouped(
        inner: &'a mut dyn RingNet,
        members: Vec<u32>,
        generation: u64,
        ready: BTreeSet<u32>,
    ) -> Self {
        Self::build(inner, members, generation, ready)
    }

    fn build(
        inner: &'a mut dyn RingNet,
        members: Vec<u32>,
        generation: u64,
        ready: BTreeSet<u32>,
    ) -> Self {
        let logical = members
            .iter()
            .enumerate()
            .map(|(k, m)| (*m, k as u32))
            .collect();
        Self {
            inner,
            members,
            logical,
            generation,
            ready,
            unread: VecDeque::new(),
            early: Early::default(),
        }
    }

    /// What arrived of later generations while this view was in use.
    pub fn take_early(&mut self) -> Early {
        std::mem::take(&mut self.early)
    }

    /// Whether `e` is the failure of a node that is no longer in the ring (its links report
    /// their end more than once: the reader, then a writer's failed send).
    fn former(&self, e: &TransportError) -> bool {
        e.failed_peer()
            .is_some_and(|p| !self.logical.contains_key(&p))
    }

    /// The physical rank of logical rank `k`.
    pub fn physical(&self, k: u32) -> u32 {
        self.members.get(k as usize).copied().unwrap_or(u32::MAX)
    }

    /// The ring's members, physical ranks in ring order.
    pub fn members(&self) -> &[u32] {
        &self.members
    }

    /// The underlying transport.
    pub fn inner(&mut self) -> &mut dyn RingNet {
        self.inner
    }

    /// A message from physical `from`: `Some((logical, message))` when it belongs to this
    /// generation, `None` when it is dropped (and a marker is taken note of).
    fn admit(&mut self, from: u32, message: Message) -> Option<(u32, Message)> {
        let &k = self.logical.get(&from)?;
        let message = self.early.keep(self.generation, from, message)?;
        if let Some(RingMessage::Rejoined { generation }) = RingMessage::peek(&message) {
            if generation == self.generation {
                self.ready.insert(from);
            }
            return None;
        }
        match &message {
            Message::Control(Control::Regroup { generation, .. })
                if from == self.members[0] && *generation == self.generation =>
            {
                self.ready.insert(from);
                None
            }
            _ if self.ready.contains(&from) => Some((k, message)),
            _ => None,
        }
    }
}

impl Transport for Members<'_> {
    fn rank(&self) -> u32 {
        self.logical
            .get(&self.inner.rank())
            .copied()
            .unwrap_or(u32::MAX)
    }

    fn peers(&self) -> Vec<u32> {
        let me = self.rank();
        (0..self.members.len() as u32)
            .filter(|k| *k != me)
            .collect()
    }

    fn peer_name(&self, rank: u32) -> PeerName {
        self.inner.peer_name(self.physical(rank))
    }

    fn send(&self, to: u32, message: Message) -> std::result::Result<(), TransportError> {
        self.inner.send(self.physical(to), message)
    }

    fn recv(&mut self, wait: Duration) -> std::result::Result<(u32, Message), TransportError> {
        if let Some(m) = self.unread.pop_front() {
            return Ok(m);
        }
        let deadline = self.inner.clock().now() + wait;
        loop {
            let left = deadline.saturating_sub(self.inner.clock().now());
            let (from, message) = match self.inner.recv(left) {
                Ok(x) => x,
                Err(e) if self.former(&e) => continue,
                Err(e) => return Err(e),
            };
            if let Some(admitted) = self.admit(from, message) {
                return Ok(admitted);
            }
        }
    }

    fn try_recv(&mut self) -> std::result::Result<Option<(u32, Message)>, TransportError> {
        if let Some(m) = self.unread.pop_front() {
            return Ok(Some(m));
        }
        loop {
            let next = match self.inner.try_recv() {
                Err(e) if self.former(&e) => continue,
                other => other?,
            };
            match next {
                None => return Ok(None),
                Some((from, message)) => {
                    if let Some(admitted) = self.admit(from, message) {
                        return Ok(Some(admitted));
                    }
                }
            }
        }
    }

    fn recv_from(
        &mut self,
        from: u32,
        wait: Duration,
    ) -> std::result::Result<Message, TransportError> {
        if let Some(i) = self.unread.iter().position(|(k, _)| *k == from)
            && let Some((_, message)) = self.unread.remove(i)
        {
            return Ok(message);
        }
        let physical = self.physical(from);
        let deadline = self.inner.clock().now() + wait;
        loop {
            let left = deadline.saturating_sub(self.inner.clock().now());
            // The inner transport keeps other peers' messages for later receives, which pass
            // through `admit` then.
            let message = match self.inner.recv_from(physical, left) {
                Ok(m) => m,
                Err(e) if self.former(&e) => continue,
                Err(e) => return Err(e),
            };
            if let Some((_, message)) = self.admit(physical, message) {
                return Ok(message);
            }
        }
    }

    fn unread(&mut self, from: u32, message: Message) {
        self.unread.push_front((from, message));
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

    fn close(&mut self) -> std::result::Result<(), TransportError> {
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

impl RingNet for Members<'_> {
    // A ring of rings' group traffic is the view underneath's (the copies of a stage in the
    // other rings are not members of this ring).
    fn average_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
    ) -> std::result::Result<(), TransportError> {
        self.inner.average_with_replicas(step, values)
    }

    fn gossip_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
        last: bool,
    ) -> std::result::Result<(), TransportError> {
        self.inner.gossip_with_replicas(step, values, last)
    }

    fn ring_regrouped(
        &mut self,
        generation: u64,
        members: &[u32],
    ) -> std::result::Result<(), TransportError> {
        self.inner.ring_regrouped(generation, members)
    }

    fn replica_outer_state(&self) -> Vec<f32> {
        self.inner.replica_outer_state()
    }

    fn restore_outer_state(
        &mut self,
        params: &[f32],
        velocity: &[f32],
    ) -> std::result::Result<(), TransportError> {
        self.inner.restore_outer_state(params, velocity)
    }
}

/// A re-formation decided by the master.
struct Regroup {
    generation: u64,
    members: Vec<u32>,
    step: u64,
}

/// Runs physical rank `rank` of a ring with stage replicas: the ring, and after a non-master
/// node's death the ring again on the survivors from the last complete replication round, as
/// often as the replicas allow. The master returns the summary, with each heal listed.
pub fn run(job: &RingJob, rank: u32, cx: &mut crate::net::RingCx<'_>) -> Result<Option<Summary>> {
    let world = job.partition.len() as u32;
    let clock = cx.net.clock();
    let data = if rank == 0 { Some(cx.data()?) } else { None };
    let timeout = job.recv_timeout();
    let mut job = job.clone();
    let mut members: Vec<u32> = (0..world).collect();
    let mut generation = 0u64;
    // Peers whose marker of this generation is not needed (all at the start; the master after
    // its Regroup, which a worker consumed before building the view).
    let mut ready: BTreeSet<u32> = members.iter().copied().collect();
    let mut replicas = Replicas::default();
    let mut initial: Option<Snapshot> = None;
    let mut heals: Vec<Restart> = Vec::new();
    let mut dropped: Vec<DroppedNode> = Vec::new();
    let mut detected_at = Duration::ZERO;
    // The master's record of the run, one across every ring a heal forms.
    let mut record = crate::run::master::RunRecord::default();
    loop {
        let mut view = Members::regrouped(cx.net, members.clone(), generation, ready.clone());
        let outcome = if rank == 0 {
            let setup = MasterSetup {
                data: data.ok_or_else(|| Error::Config("the master needs the dataset".into()))?,
            };
            // A heal's downtime ends when the healed ring completes its first mini-batch.
            let mut pending = heals.last_mut().filter(|h| h.downtime_seconds == 0.0);
            let heal_clock = clock.clone();
            let on_event = &mut *cx.on_event;
            let mut events = |e: &ringtmp_contract::Event| {
                if let (ringtmp_contract::Event::Step { .. }, Some(h)) = (e, pending.as_deref_mut())
                {
                    h.downtime_seconds = heal_clock.now().saturating_sub(detected_at).as_secs_f64();
                    pending = None;
                }
                on_event(e);
            };
            run_master_with(
                &job,
                &setup,
                &mut view,
                &mut events,
                initial.as_ref(),
                &mut replicas,
                &mut record,
            )
            .map(|o| Some(o.summary))
        } else {
            run_worker_with(&job, &mut view, initial.as_ref(), &mut replicas).map(|_| None)
        };
        let mut early = view.take_early();
        let failure = match outcome {
            Ok(Some(summary)) => {
                return with_heals(summary, &job, &members, dropped, heals).map(Some);
            }
            Ok(None) => return Ok(None),
            Err(e) => e,
        };
        let detected = clock.now();
        let failure_text = failure.to_string();
        detected_at = detected;
        let regroup = if rank == 0 {
            let Some(dead) = failed_member(&failure, &members) else {
                return Err(failure);
            };
            let mut lead = Lead {
                generation: &mut generation,
                dropped: &mut dropped,
                heals: &mut heals,
            };
            let (next, regroup) =
                lead.decide(&job, &members, dead, &failure, &replicas, detected, cx)?;
            job = next;
            regroup
        } else {
            match failure {
                Error::Regroup {
                    generation,
                    members,
                    step,
                } => Regroup {
                    generation,
                    members,
                    step,
                },
                e if failed_member(&e, &members).is_some() => {
                    await_regroup(cx.net, generation, timeout, &e, &mut early)?
                }
                e => return Err(e),
            }
        };
        tracing::debug!(
            rank,
            generation = regroup.generation,
            members = ?regroup.members,
            step = regroup.step,
            "re-forming the ring after: {failure_text}"
        );
        let step = regroup.step;
        let state = restored(rank, &members, &regroup, &replicas)?;
        // Rings of rings: the view learns who holds each stage now (the master tells the other
        // rings), and the outer state of the layers this node holds comes from the snapshot.
        cx.net
            .ring_regrouped(regroup.generation, &regroup.members)?;
        cx.net
            .restore_outer_state(&state.params, &state.outer_velocity)?;
        if rank != 0 {
            let mut current = members.clone();
            for d in policy::departed(&members, &regroup.members) {
                let (next, rest) = without(&job, &current, d)?;
                (job, current) = (next, rest);
            }
            generation = regroup.generation;
        }
        members = regroup.members;
        // This node's marker to everyone else of the new ring; the master's was its Regroup.
        if rank != 0 {
            for &m in members.iter().filter(|m| **m != rank) {
                cx.net
                    .send(m, RingMessage::Rejoined { generation }.to_message())?;
            }
        }
        ready = if rank == 0 {
            BTreeSet::from([0])
        } else {
            BTreeSet::from([0, rank])
        };
        ready.extend(early.release(generation, cx.net));
        job.spec.resume_from = Some(ringtmp_contract::ResumePoint {
            dir: std::path::PathBuf::new(),
            step,
        });
        initial = Some(state);
        // Rounds of the old ring do not describe the new one.
        replicas.completed = None;
    }
}

/// A healed run's summary: the nodes' ranks as the run started them (they reported their rank
/// in the healed ring), the nodes dropped and the heals; rewritten to `summary.json`.
fn with_heals(
    mut summary: Summary,
    job: &RingJob,
    members: &[u32],
    dropped: Vec<DroppedNode>,
    heals: Vec<Restart>,
) -> Result<Summary> {
    if heals.is_empty() {
        return Ok(summary);
    }
    for node in &mut summary.per_node {
        node.rank = members
            .get(node.rank as usize)
            .copied()
            .unwrap_or(node.rank);
    }
    summary.dropped_nodes.extend(dropped);
    summary.heals = heals;
    let path = job.spec.out.join("summary.json");
    let text = serde_json::to_string_pretty(&summary)
        .map_err(|e| Error::Config(format!("encoding the summary: {e}")))?;
    ringtmp_model::checkpoint::write_atomic(&path, text.as_bytes())?;
    Ok(summary)
}

/// The master's side of a heal: what the run records of it across rings.
struct Lead<'a> {
    generation: &'a mut u64,
    dropped: &'a mut Vec<DroppedNode>,
    heals: &'a mut Vec<Restart>,
}

impl Lead<'_> {
    /// Decides the heal around dead member `dead` (`policy::decide`), orders every survivor to
    /// regroup, tells the user and records the drop and the heal. Returns the healed ring's job
    /// and the order.
    fn decide(
        &mut self,
        job: &RingJob,
        members: &[u32],
        dead: u32,
        failure: &Error,
        replicas: &Replicas,
        detected: Duration,
        cx: &mut crate::net::RingCx<'_>,
    ) -> Result<(RingJob, Regroup)> {
        let policy::Heal {
            dead,
            pred,
            survivors,
            step,
            failed_at,
        } = policy::decide(members, dead, replicas.completed, replicas.last_step)
            .and_then(|heal| {
                // Rings of rings: the other rings' copies must not have synchronised since.
                if job.replicas > 1 {
                    policy::check_synchronisation(
                        heal.step,
                        replicas.last_step,
                        job.average_every,
                        job.spec.total_steps,
                    )?;
                }
                Ok(heal)
            })
            .map_err(|why| Error::Config(format!("{failure}; {why}")))?;
        let (next, _) = without(job, members, dead)?;
        *self.generation += 1;
        let generation = *self.generation;
        for &m in survivors.iter().filter(|m| **m != 0) {
            cx.net.send(
                m,
                Message::Control(Control::Regroup {
                    generation,
                    members: survivors.clone(),
                    step,
                    optimizer_steps: 0,
                }),
            )?;
        }
        (cx.on_event)(&ringtmp_contract::Event::Notice {
            text: format!(
                "ring: rank {dead} left ({failure}); rank {pred} takes its layers from the \
                 replica of mini-batch {step}, and the ring goes on with {} nodes",
                survivors.len()
            ),
        });
        self.dropped.push(DroppedNode {
            rank: dead,
            step: failed_at,
            reason: failure.to_string(),
        });
        self.heals.push(Restart {
            rank: dead,
            reason: format!("healed: rank {pred} took its layers over from its replica"),
            failed_at_step: failed_at,
            resumed_from_step: step,
            steps_redone: failed_at.saturating_sub(step),
            nodes: survivors.len() as u32,
            work_lost_seconds: replicas
                .completed_at
                .map_or(0.0, |at| detected.saturating_sub(at).as_secs_f64()),
            // Set when the healed ring completes its first mini-batch.
            downtime_seconds: 0.0,
        });
        Ok((
            next,
            Regroup {
                generation,
                members: survivors,
                step,
            },
        ))
    }
}

/// What survivor `rank` goes on from after `regroup`: its own snapshot of the round, joined
/// with its successor's replica when the successor is the one that died (`policy::restore`).
fn restored(
    rank: u32,
    members: &[u32],
    regroup: &Regroup,
    replicas: &Replicas,
) -> Result<Snapshot> {
    let step = regroup.step;
    let own = replicas.own_at(step).cloned().ok_or_else(|| {
        Error::Config(format!("rank {rank} has no snapshot of mini-batch {step}"))
    })?;
    Ok(match policy::restore(rank, members, &regroup.members) {
        policy::Restore::OwnAndSuccessor => {
            let replica = replicas.succ_at(step).ok_or_else(|| {
                Error::Config(format!("rank {rank} has no replica of mini-batch {step}"))
            })?;
            own.joined(replica)
        }
        policy::Restore::Own => own,
    })
}

/// The member whose failure `e` reports, if it is a non-master member.
fn failed_member(e: &Error, members: &[u32]) -> Option<u32> {
    match e {
        Error::Transport(t) => t.failed_peer().filter(|r| *r != 0 && members.contains(r)),
        _ => None,
    }
}

/// A worker that saw a peer die waits for the master's re-formation (newer than `generation`),
/// dropping everything else but the markers of survivors that heard of it first (kept in
/// `early`); other peers' failures are the master's to handle.
fn await_regroup(
    net: &mut dyn RingNet,
    generation: u64,
    timeout: Duration,
    cause: &Error,
    early: &mut Early,
) -> Result<Regroup> {
    let clock = net.clock();
    let deadline = clock.now() + timeout;
    loop {
        let left = deadline.saturating_sub(clock.now());
        if left.is_zero() {
            return Err(Error::Config(format!(
                "{cause}; the master did not re-form the ring within {timeout:?}"
            )));
        }
        match net.recv(left) {
            Ok((
                0,
                Message::Control(Control::Regroup {
                    generation: g,
                    members,
                    step,
                    ..
                }),
            )) if g > generation => {
                return Ok(Regroup {
                    generation: g,
                    members,
                    step,
                });
            }
            Ok((from, message)) => {
                // Everything else of the old ring is dropped.
                let _ = early.keep(generation, from, message);
            }
            Err(e) if e.failed_peer().is_some_and(|r| r != 0) => {}
            Err(e) => return Err(e.into()),
        }
    }
}
