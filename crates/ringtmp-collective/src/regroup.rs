//! Re-forming the all-reduce ring around a dead worker, as two sans-IO machines: [`Lead`] (rank
//! 0, which decides) and [`Follow`] (every other survivor). Events go in (`handle_*`), actions
//! come out; the driver does the sending and receiving, so the policy is tested from tables of
//! cases (`tests/protocols.rs` over `tests/data/regroup/`) without a network.
//!
//! The protocol. Rank 0 abandons its step in progress, removes the dead rank, bumps the ring's
//! generation and sends every other member the order (`Regroup { generation, members, step,
//! optimizer_steps }`). Each member answers with the optimizer steps it has completed
//! (`Holding`); rank 0 sends its parameters and optimizer state only to the members whose count
//! differs from its own (replicas that completed the same steps hold the same bits). A member
//! that dies meanwhile is dropped as well and the order goes out again, one generation later.
//!
//! Invariants the machines keep: the generation grows by one per rank dropped; a member is
//! dropped once; rank 0 waits for the members' answers in ring order and for nothing from a
//! member it knows dead; an answer of an older generation is stale and ignored, a newer one is a
//! protocol error; a follower acts only on an order newer than its ring, answers each order once,
//! and finishes either on an order whose step count equals its own or on the state that follows.

use std::collections::{BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

/// The tag of the regroup's wire messages: it re-forms all-reduce rings (DiLoCo's too).
pub const MESSAGES: &str = "allreduce";

/// The regroup's own wire messages (as [`ringtmp_contract::messages::StrategyMessage`]s).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllReduceMessage {
    /// A follower's answer to an order: the optimizer steps its replica has completed.
    Holding {
        /// The order's generation.
        generation: u64,
        /// Its replica's optimizer steps.
        optimizer_steps: u64,
    },
}

impl ringtmp_contract::messages::StrategyMessage for AllReduceMessage {
    const STRATEGY: &'static str = MESSAGES;

    fn kind(&self) -> &'static str {
        match self {
            Self::Holding { .. } => "Holding",
        }
    }
}

/// Rank 0's order to re-form the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order {
    /// The new ring's generation (chunks carry it).
    pub generation: u64,
    /// The live workers, in ring order.
    pub members: Vec<u32>,
    /// The step every member goes on from.
    pub step: u64,
    /// The optimizer steps rank 0 has completed.
    pub optimizer_steps: u64,
}

/// What rank 0 does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeadAction {
    /// Tell the user (a dropped rank, a member that takes rank 0's state).
    Notice(String),
    /// Record the rank as dropped from the run at `step`.
    Dropped {
        /// The dead rank.
        rank: u32,
        /// The step it left at.
        step: u64,
        /// Why it was taken for dead.
        reason: String,
    },
    /// Send the order to `to`.
    SendOrder {
        /// The member.
        to: u32,
        /// The order.
        order: Order,
    },
    /// Send rank 0's parameters and optimizer state to `to`, tagged with `generation`.
    SendState {
        /// The member whose step count differs.
        to: u32,
        /// The generation the state belongs to.
        generation: u64,
    },
    /// Receive `from`'s answer (its `Holding`).
    Await(u32),
    /// The ring is re-formed ([`Lead::members`], [`Lead::generation`]).
    Done,
    /// The run cannot go on.
    Fail(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LeadPhase {
    /// The round's orders are being sent.
    Ordering,
    /// The members' answers are being collected, in ring order.
    Collecting,
    Done,
}

/// Rank 0's side: drops the dead, orders the survivors, answers each with its state when needed.
#[derive(Debug)]
pub struct Lead {
    members: Vec<u32>,
    generation: u64,
    step: u64,
    mine: u64,
    phase: LeadPhase,
    /// Ranks found dead and not yet dropped (the next round drops them).
    lost: Vec<(u32, String)>,
    /// Ranks dropped so far.
    gone: BTreeSet<u32>,
    /// Members whose answer is still due this round, in ring order.
    due: VecDeque<u32>,
    /// The member whose answer is awaited now.
    awaited: Option<u32>,
}

impl Lead {
    /// Rank 0 of the ring `members` (of `generation`), having completed `optimizer_steps`, learns
    /// that `dead` died (`reason`) during `step`.
    pub fn start(
        members: &[u32],
        generation: u64,
        dead: u32,
        reason: String,
        step: u64,
        optimizer_steps: u64,
    ) -> (Self, Vec<LeadAction>) {
        let mut lead = Self {
            members: members.to_vec(),
            generation,
            step,
            mine: optimizer_steps,
            phase: LeadPhase::Ordering,
            lost: vec![(dead, reason)],
            gone: BTreeSet::new(),
            due: VecDeque::new(),
            awaited: None,
        };
        let actions = lead.round();
        (lead, actions)
    }

    /// The ring's members (final once [`LeadAction::Done`] came out).
    pub fn members(&self) -> &[u32] {
        &self.members
    }

    /// The ring's generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Drops the ranks found dead, then orders every other member.
    fn round(&mut self) -> Vec<LeadAction> {
        let mut actions = Vec::new();
        for (dead, reason) in std::mem::take(&mut self.lost) {
            if !self.members.contains(&dead) {
                continue;
            }
            self.members.retain(|r| *r != dead);
            self.gone.insert(dead);
            self.generation += 1;
            actions.push(LeadAction::Notice(format!(
                "all-reduce: rank {dead} left the run at step {} ({reason}); re-formed the ring \
                 on ranks {:?}, continuing from step {} with the survivors' replicas",
                self.step, self.members, self.step
            )));
            actions.push(LeadAction::Dropped {
                rank: dead,
                step: self.step,
                reason,
            });
        }
        if self.members.len() < 2 {
            self.phase = LeadPhase::Done;
            actions.push(LeadAction::Fail(
                "all-reduce: every worker but rank 0 has died; nothing left to reduce with".into(),
            ));
            return actions;
        }
        self.phase = LeadPhase::Ordering;
        self.awaited = None;
        self.due.clear();
        let order = Order {
            generation: self.generation,
            members: self.members.clone(),
            step: self.step,
            optimizer_steps: self.mine,
        };
        for &to in self.members.iter().filter(|r| **r != 0) {
            actions.push(LeadAction::SendOrder {
                to,
                order: order.clone(),
            });
        }
        actions
    }

    /// A send to, or a receive from, `rank` failed because it died.
    pub fn handle_lost(&mut self, rank: u32, reason: String) -> Vec<LeadAction> {
        if rank == 0 || self.gone.contains(&rank) || self.lost.iter().any(|(r, _)| *r == rank) {
            return Vec::new();
        }
        self.lost.push((rank, reason));
        if self.awaited == Some(rank) {
            self.awaited = None;
        }
        Vec::new()
    }

    /// `from`'s answer: the optimizer steps it has completed, for the ring of `generation`.
    pub fn handle_holding(&mut self, from: u32, generation: u64, steps: u64) -> Vec<LeadAction> {
        if self.phase != LeadPhase::Collecting || self.awaited != Some(from) {
            return vec![LeadAction::Fail(format!(
                "all-reduce: rank {from} answered when its answer was not awaited"
            ))];
        }
        if generation < self.generation {
            // The answer to an order this round replaced: the one to this order follows.
            return vec![LeadAction::Await(from)];
        }
        if generation > self.generation {
            return vec![LeadAction::Fail(format!(
                "all-reduce: rank {from} answered an order of generation {generation}, newer than \
                 rank 0's {}",
                self.generation
            ))];
        }
        self.awaited = None;
        if steps == self.mine {
            return Vec::new();
        }
        vec![
            LeadAction::Notice(format!(
                "all-reduce: rank {from} had completed {steps} step(s), rank 0 {}: it takes rank \
                 0's state",
                self.mine
            )),
            LeadAction::SendState {
                to: from,
                generation: self.generation,
            },
        ]
    }

    /// Every action so far has been carried out: what next.
    pub fn handle_idle(&mut self) -> Vec<LeadAction> {
        match self.phase {
            LeadPhase::Done => Vec::new(),
            LeadPhase::Ordering => {
                if !self.lost.is_empty() {
                    return self.round();
                }
                self.phase = LeadPhase::Collecting;
                self.due = self.members.iter().copied().filter(|r| *r != 0).collect();
                self.next_answer()
            }
            LeadPhase::Collecting => match self.awaited {
                Some(r) => vec![LeadAction::Await(r)],
                None => self.next_answer(),
            },
        }
    }

    fn next_answer(&mut self) -> Vec<LeadAction> {
        while let Some(r) = self.due.pop_front() {
            if self.lost.iter().any(|(l, _)| *l == r) {
                continue;
            }
            self.awaited = Some(r);
            return vec![LeadAction::Await(r)];
        }
        if !self.lost.is_empty() {
            return self.round();
        }
        self.phase = LeadPhase::Done;
        vec![LeadAction::Done]
    }
}

/// What a follower does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FollowAction {
    /// Wait for rank 0's order (anything from anyone may come first).
    AwaitOrder,
    /// Tell rank 0 the steps this replica has completed, for the order of `generation`.
    SendHolding {
        /// The order's generation.
        generation: u64,
        /// This replica's optimizer steps.
        steps: u64,
    },
    /// Wait for rank 0's state (or a newer order) on rank 0's link.
    AwaitState,
    /// Load the state just received, at rank 0's optimizer step count.
    LoadState {
        /// Rank 0's optimizer steps.
        optimizer_steps: u64,
    },
    /// The ring is re-formed: go on under this order.
    Finish(Order),
    /// The run cannot go on.
    Fail(String),
}

/// What a follower does with a reduction chunk that arrives while it waits for the order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkFate {
    /// From the abandoned attempt: drop it.
    Drop,
    /// From the new ring, sent by a worker that heard the order first: keep it for after.
    Keep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FollowPhase {
    AwaitingOrder,
    AwaitingState,
    Done,
}

/// A survivor other than rank 0: waits for the order, answers it, takes rank 0's state if its
/// own steps differ.
#[derive(Debug)]
pub struct Follow {
    rank: u32,
    /// The generation of the ring it ran on.
    ring_generation: u64,
    /// Its replica's optimizer steps.
    steps: u64,
    order: Option<Order>,
    phase: FollowPhase,
}

impl Follow {
    /// `rank`, whose replica completed `steps` optimizer steps on the ring of `ring_generation`.
    pub fn new(rank: u32, ring_generation: u64, steps: u64) -> Self {
        Self {
            rank,
            ring_generation,
            steps,
            order: None,
            phase: FollowPhase::AwaitingOrder,
        }
    }

    /// An order from rank 0.
    pub fn handle_order(&mut self, order: Order) -> Vec<FollowAction> {
        let newer_than = match (&self.phase, &self.order) {
            (FollowPhase::AwaitingOrder, _) => self.ring_generation,
            (FollowPhase::AwaitingState, Some(current)) => current.generation,
            _ => {
                return vec![FollowAction::Fail(
                    "all-reduce: an order after the ring was re-formed".into(),
                )];
            }
        };
        if order.generation <= newer_than {
            return vec![FollowAction::Fail(format!(
                "all-reduce: an order of generation {} where one newer than {newer_than} was due",
                order.generation
            ))];
        }
        if !order.members.contains(&self.rank) {
            self.phase = FollowPhase::Done;
            return vec![FollowAction::Fail(format!(
                "all-reduce: rank 0 re-formed the ring without rank {} (it took it for dead)",
                self.rank
            ))];
        }
        let mut actions = vec![FollowAction::SendHolding {
            generation: order.generation,
            steps: self.steps,
        }];
        if order.optimizer_steps == self.steps {
            self.phase = FollowPhase::Done;
            actions.push(FollowAction::Finish(order.clone()));
        } else {
            self.phase = FollowPhase::AwaitingState;
            actions.push(FollowAction::AwaitState);
        }
        self.order = Some(order);
        actions
    }

    /// A reduction chunk of ring `generation` arrived while the order is awaited.
    pub fn handle_chunk(&self, generation: u64) -> ChunkFate {
        if generation <= self.ring_generation {
            ChunkFate::Drop
        } else {
            ChunkFate::Keep
        }
    }

    /// A state of `generation` holding `values` values arrived on rank 0's link, where
    /// `expected` make a state.
    pub fn handle_state(
        &mut self,
        generation: u64,
        values: u64,
        expected: u64,
    ) -> Vec<FollowAction> {
        let Some(order) = self
            .order
            .clone()
            .filter(|_| self.phase == FollowPhase::AwaitingState)
        else {
            return vec![FollowAction::Fail(
                "all-reduce: rank 0's state when none was due".into(),
            )];
        };
        if generation != order.generation || values != expected {
            return vec![FollowAction::Fail(format!(
                "all-reduce: rank 0's state of generation {generation} with {values} values, \
                 where generation {} with {expected} was due",
                order.generation
            ))];
        }
        self.phase = FollowPhase::Done;
        vec![
            FollowAction::LoadState {
                optimizer_steps: order.optimizer_steps,
            },
            FollowAction::Finish(order),
        ]
    }

    /// Every action so far has been carried out: what next.
    pub fn handle_idle(&self) -> Vec<FollowAction> {
        match self.phase {
            FollowPhase::AwaitingOrder => vec![FollowAction::AwaitOrder],
            FollowPhase::AwaitingState => vec![FollowAction::AwaitState],
            FollowPhase::Done => Vec::new(),
        }
    }
}
