//! Elastic rings: re-forming the ring of a reduction around a dead member, carried out over the
//! transport as [`super::regroup`]'s pure machines decide. Rank 0 leads; every other member
//! follows its order, and takes rank 0's state where its count of completed updates differs.
//! What the state is belongs to the strategy ([`Replica`]): all-reduce SGD's model and
//! optimizer, DiLoCo's outer parameters and outer momentum.
//!
//! Invariants: a member's own death or rank 0's ends the run (rank 0 holds the outputs); what
//! arrives of an abandoned attempt is dropped, what arrives of the new ring waits for it; every
//! wait has the job's timeout and names the peer.

use std::collections::VecDeque;
use std::time::Duration;

use ringtmp_metrics::DroppedNode;
use ringtmp_model::{Optimizer, Stage};
use ringtmp_transport::{Transport, TransportError};
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Control, Dtype, Message, TensorTag};
use serde_json::json;

use super::reduce::{Break, Ring, chunk_parts};
use super::regroup::{AllReduceMessage, ChunkFate, Follow, FollowAction, Lead, LeadAction, Order};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;

/// What a re-formed ring copies from rank 0 to a member whose count of completed updates
/// differs from rank 0's: the state every member must share to go on together.
pub trait Replica {
    /// Updates completed: members whose counts equal rank 0's hold the same bits.
    fn updates(&self) -> u64;
    /// The shared state, flat.
    fn flat(&self) -> Vec<f32>;
    /// How many values [`Replica::flat`] holds.
    fn flat_len(&self) -> usize;
    /// Takes rank 0's flat state, of `updates` updates (checked to hold `flat_len` values).
    fn load(&mut self, values: &[f32], updates: u64) -> Result<()>;
}

/// A whole model and its optimizer: all-reduce SGD's shared state (every replica applies the
/// same step).
pub struct ModelReplica<'a> {
    /// The replica.
    pub stage: &'a mut Stage,
    /// Its optimizer.
    pub optimizer: &'a mut Optimizer,
}

impl Replica for ModelReplica<'_> {
    fn updates(&self) -> u64 {
        self.optimizer.steps()
    }

    fn flat(&self) -> Vec<f32> {
        let mut state = self.stage.params().to_vec();
        for (_, values) in self.optimizer.state() {
            state.extend_from_slice(values);
        }
        state
    }

    fn flat_len(&self) -> usize {
        self.stage.params().len()
            + self
                .optimizer
                .state()
                .iter()
                .map(|(_, v)| v.len())
                .sum::<usize>()
    }

    fn load(&mut self, values: &[f32], updates: u64) -> Result<()> {
        let params = self.stage.params().len();
        self.stage.params_mut().copy_from_slice(&values[..params]);
        let mut at = params;
        let tensors: Vec<(&str, Vec<f32>)> = self
            .optimizer
            .state()
            .iter()
            .map(|(name, v)| {
                let t = (*name, values[at..at + v.len()].to_vec());
                at += v.len();
                t
            })
            .collect();
        self.optimizer.load_state(&tensors, updates)?;
        Ok(())
    }
}

/// Rank 0 re-forms the ring without `dead`, carrying out what [`Lead`] decides: every other
/// member gets the order and answers with the steps it has completed; rank 0 sends its state only
/// to the members whose count differs from its own — replicas that completed the same steps hold
/// the same bits, so in the usual case no state travels at all, where sending it to every
/// survivor over rank 0's one card cost 5 s per survivor at 100 Mbit/s (docs/BENCHMARKS.md,
/// "Failures per node-hour"). All go on from `step` (rank 0 abandons the step in progress, so it
/// has completed exactly the steps before it; a worker that completed one more redoes it, one
/// that completed one fewer catches up).
pub fn reform_ring(
    net: &mut dyn Transport,
    ring: &mut Ring,
    dead: u32,
    reason: String,
    step: u64,
    replica: &dyn Replica,
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
        replica.updates(),
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
                let values = state.get_or_insert_with(|| replica.flat());
                let message =
                    crate::whole_model::model_message(net, values, step, generation, Dtype::F32);
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
pub fn follow_regroup(
    net: &mut dyn Transport,
    rank: u32,
    ring: &mut Ring,
    order: Option<Order>,
    replica: &mut dyn Replica,
    timeout: Duration,
    notices: &mut Vec<String>,
) -> Result<u64> {
    let mut follow = Follow::new(rank, ring.generation, replica.updates());
    let mut actions: VecDeque<FollowAction> = match order {
        Some(order) => follow.handle_order(order).into(),
        None => VecDeque::new(),
    };
    // Chunks of the new ring from workers that heard of it first wait for it here.
    let mut newer: Vec<(u32, Message)> = Vec::new();
    let expected = replica.flat_len();
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
                    replica.load(&received, optimizer_steps)?;
                }
            }
            FollowAction::Finish(order) => break order,
            FollowAction::Fail(why) => return Err(Error::Config(why)),
        }
    };
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

/// A worker's part in re-forming the ring after a step broke (a member died, or rank 0 ordered
/// a regroup): rank 0 leads the survivors; the others follow its order. The step is abandoned
/// and the survivors go on from rank 0's replica.
pub struct Regrouping {
    /// This worker's rank.
    pub rank: u32,
    /// The step that broke.
    pub step: u64,
    /// How long to wait for any one peer before it counts as dead.
    pub timeout: std::time::Duration,
}

impl Regrouping {
    /// Re-forms `ring` after `broke`; returns the step to go on from.
    pub fn after(
        &self,
        broke: Break,
        net: &mut dyn Transport,
        ring: &mut Ring,
        replica: &mut dyn Replica,
        dropped: &mut Vec<DroppedNode>,
        recorder: Option<&mut ringtmp_contract::recorder::RunRecorder>,
        on_event: &mut dyn FnMut(&ringtmp_contract::Event),
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
                    replica,
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
                replica,
                self.timeout,
                &mut notices,
            )?,
            Break::Regroup(order) => follow_regroup(
                net,
                self.rank,
                ring,
                Some(order),
                replica,
                self.timeout,
                &mut notices,
            )?,
        };
        for text in notices {
            on_event(&ringtmp_contract::Event::Notice { text });
        }
        Ok(step)
    }
}
