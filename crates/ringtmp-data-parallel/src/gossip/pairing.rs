//! One AD-PSGD worker's side of the pairwise averaging, without I/O: events in (`handle_*`: a
//! model arrived, a neighbour finished or died, rank 0 granted iterations or said stop, an
//! iteration begins or the run ends), actions out ([`PairAction`]: send our model, answer with
//! it, average, tell a neighbour we finished, report who left, fail). The worker's run loop in
//! [`super::adpsgd`] does what the actions say with the transport and the model; the protocol's
//! rules are here, table-tested in `tests/data/pairing/`.
//!
//! The rules (Lian et al., 2018, with the bipartite graph of [`ringtmp_collective::mixing`]):
//! - an *active* worker asks one live passive neighbour per iteration, drawn at random, and
//!   waits for that neighbour's answer alone; its model does not change between the request and
//!   the answer, so the pair ends with one average;
//! - a *passive* worker answers every request from a live active neighbour with its model as it
//!   was, then averages; it never waits for anyone until the end, when it waits for each live
//!   active neighbour's `Finished` (so nobody waits in a circle);
//! - a neighbour that died is skipped from then on; what it sent before its death and is read
//!   after it was noticed is ignored; an awaited answer from it is given up (no average);
//! - rank 0's death, or a message the rules do not allow, ends the run.
//!
//! Invariants: at most one request is outstanding, and only on an active worker; an average
//! happens only on the answer to that request (active) or on a request from a live active
//! neighbour (passive); grants only grow; a dead rank is never asked or awaited again.

use std::collections::BTreeSet;

use ringtmp_collective::mixing;

/// What the worker must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PairAction {
    /// Send our model to `to`, asking it to average (for our iteration `iteration`).
    Request {
        /// The passive neighbour drawn.
        to: u32,
        /// Our iteration, which its answer carries back.
        iteration: u64,
    },
    /// Send our model, as it is now, to `to` as the answer to its request; then average ours
    /// with the one it sent.
    Answer {
        /// The active neighbour that asked.
        to: u32,
    },
    /// Average our model with the answer received.
    Average,
    /// Tell passive neighbour `to` that we have finished our iterations.
    Finished {
        /// The neighbour released.
        to: u32,
    },
    /// Neighbour `rank` left the run; we go on without it.
    Left {
        /// The dead neighbour.
        rank: u32,
    },
    /// The rules were broken, or the run cannot go on: end it, for this reason.
    Fail(String),
}

/// One worker's pairing state.
#[derive(Clone, Debug)]
pub struct Pairing {
    rank: u32,
    active: bool,
    /// Live gossip neighbours (all of the other colour).
    near: BTreeSet<u32>,
    /// Ranks whose death this worker has noticed.
    gone: BTreeSet<u32>,
    /// Passive: active neighbours that have finished (or died).
    finished: BTreeSet<u32>,
    /// Active: the neighbour asked and the iteration its answer must carry.
    awaiting: Option<(u32, u64)>,
    /// Iterations this worker may complete (rank 0's grants).
    allowed: u64,
    stopped: bool,
}

impl Pairing {
    /// Worker `rank` of `workers`, allowed `allowed` iterations before rank 0's first grant;
    /// `None` when the graph on `workers` is not bipartite.
    pub fn new(rank: u32, workers: u32, allowed: u64) -> Option<Self> {
        let neighbours = |r| mixing::bipartite_neighbours(r, workers);
        let colours = mixing::two_colouring(workers, neighbours)?;
        Some(Self {
            rank,
            active: !*colours.get(rank as usize)?,
            near: neighbours(rank),
            gone: BTreeSet::new(),
            finished: BTreeSet::new(),
            awaiting: None,
            allowed,
            stopped: false,
        })
    }

    /// Whether this worker is active (it asks) rather than passive (it answers).
    pub fn active(&self) -> bool {
        self.active
    }

    /// The live neighbours.
    pub fn near(&self) -> &BTreeSet<u32> {
        &self.near
    }

    /// Whether `rank`'s death has been noticed (its messages are then old news).
    pub fn is_gone(&self, rank: u32) -> bool {
        self.gone.contains(&rank)
    }

    /// The neighbour whose answer this worker waits for.
    pub fn awaiting(&self) -> Option<u32> {
        self.awaiting.map(|(rank, _)| rank)
    }

    /// Whether rank 0 said stop.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Whether a worker that has completed `iterations` may begin another.
    pub fn may_iterate(&self, iterations: u64) -> bool {
        !self.stopped && iterations < self.allowed
    }

    /// Passive: whether every live active neighbour has finished (an active worker is never
    /// held at the end).
    pub fn released(&self) -> bool {
        self.active || self.near.iter().all(|a| self.finished.contains(a))
    }

    /// Iteration `iteration` begins: an active worker asks a live passive neighbour, the one
    /// `draw(count)` picks by index among them (it has none left: it trains alone).
    pub fn handle_iteration(
        &mut self,
        iteration: u64,
        draw: impl FnOnce(usize) -> usize,
    ) -> Vec<PairAction> {
        if !self.active || self.near.is_empty() {
            return Vec::new();
        }
        if self.awaiting.is_some() {
            return vec![fail(&format!(
                "answer awaited from rank {} when an iteration began",
                self.awaiting().unwrap_or_default()
            ))];
        }
        let index = draw(self.near.len()) % self.near.len();
        let to = *self
            .near
            .iter()
            .nth(index)
            .expect("index within the live neighbours");
        self.awaiting = Some((to, iteration));
        vec![PairAction::Request { to, iteration }]
    }

    /// A model for averaging arrived from `from`, tagged with the asker's `iteration`.
    pub fn handle_model(&mut self, from: u32, iteration: u64) -> Vec<PairAction> {
        if self.active {
            if self.awaiting == Some((from, iteration)) {
                self.awaiting = None;
                return vec![PairAction::Average];
            }
            return vec![fail(&format!(
                "averaging model from rank {from} for iteration {iteration} (not asked for)"
            ))];
        }
        if !self.near.contains(&from) {
            return vec![fail(&format!(
                "request to average from rank {from} (not a live active neighbour)"
            ))];
        }
        vec![PairAction::Answer { to: from }]
    }

    /// Rank `from` says this worker may complete `iterations` iterations in all.
    pub fn handle_allow(&mut self, from: u32, iterations: u64) -> Vec<PairAction> {
        if from != 0 {
            return vec![fail(&format!(
                "grant from rank {from} (only rank 0 grants)"
            ))];
        }
        self.allowed = self.allowed.max(iterations);
        Vec::new()
    }

    /// Rank `from` says the run's steps are done.
    pub fn handle_stop(&mut self, from: u32) -> Vec<PairAction> {
        if from != 0 {
            return vec![fail(&format!(
                "order to stop from rank {from} (only rank 0 gives it)"
            ))];
        }
        self.stopped = true;
        Vec::new()
    }

    /// Active neighbour `from` has finished its iterations.
    pub fn handle_finished(&mut self, from: u32) -> Vec<PairAction> {
        if self.active || !self.near.contains(&from) {
            return vec![fail(&format!(
                "'finished' from rank {from} (not from a live active neighbour)"
            ))];
        }
        self.finished.insert(from);
        Vec::new()
    }

    /// The link to `rank` failed (`reason`): a neighbour or another worker is dropped; rank 0's
    /// death, or this worker's own, ends the run.
    pub fn handle_lost(&mut self, rank: u32, reason: &str) -> Vec<PairAction> {
        if rank == 0 || rank == self.rank {
            return vec![fail(reason)];
        }
        self.gone.insert(rank);
        if self.awaiting() == Some(rank) {
            self.awaiting = None;
        }
        let newly = self.near.remove(&rank) | self.finished.insert(rank);
        if newly {
            vec![PairAction::Left { rank }]
        } else {
            Vec::new()
        }
    }

    /// This worker has completed its iterations: an active worker releases its live passive
    /// neighbours.
    pub fn handle_end(&mut self) -> Vec<PairAction> {
        if !self.active {
            return Vec::new();
        }
        self.near
            .iter()
            .map(|&to| PairAction::Finished { to })
            .collect()
    }
}

fn fail(why: &str) -> PairAction {
    PairAction::Fail(why.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_averages_once_per_request() {
        let mut active = Pairing::new(0, 4, 10).unwrap();
        let mut passive = Pairing::new(1, 4, 10).unwrap();
        assert!(active.active() && !passive.active());
        let PairAction::Request { to, iteration } = active.handle_iteration(0, |_| 0)[0] else {
            panic!("an active worker asks")
        };
        assert_eq!((to, iteration), (1, 0));
        assert_eq!(passive.handle_model(0, 0), [PairAction::Answer { to: 0 }]);
        assert_eq!(active.handle_model(1, 0), [PairAction::Average]);
        // The same answer again is not awaited any more.
        assert!(matches!(
            active.handle_model(1, 0)[..],
            [PairAction::Fail(_)]
        ));
    }
}
