//! Rings of rings under `--replica-sync adpsgd`: the copies of a stage gossip their parameters
//! asynchronously, AD-PSGD's way (Lian et al., ICML 2018), with no ring ever waiting for
//! another until the end.
//!
//! The copies of a stage (its *group*, one per ring) form AD-PSGD's bipartite graph
//! ([`mixing::bipartite_neighbours`] over the ring indices): the copies in even rings are
//! *active*, those in odd rings *passive*. After each mini-batch a stage's node reaches a *safe
//! point* (its step is done, nothing of the next mini-batch has touched its parameters):
//! - an active copy with no exchange outstanding sends its parameters x_a to a random passive
//!   neighbour and keeps a copy of what it sent; it goes on training;
//! - a passive copy answers every request that has arrived with its parameters x_p *before*
//!   averaging, and replaces them by (x_p + x_a) / 2;
//! - an active copy whose answer has arrived adds (x_p − x_a) / 2, with x_a what it had sent:
//!   its parameters become the pair's average plus whatever steps it took meanwhile.
//!
//! Why not AD-PSGD's blocking exchange (the active worker waits for the answer before its next
//! update): a ring node that waited would stall its whole pipeline for a round trip of its
//! stage's parameters; here nothing waits, and an exchange costs a stage one copy of its
//! parameters in memory. Invariant: an exchange changes the two copies by −d/2 and +d/2 with
//! d = x_a − x_p, so the sum of the group's parameters changes only by the steps its copies
//! take (conservation, as in AD-PSGD; [`tests`]); with no steps in between, the pair ends with
//! one average.
//!
//! At the end (the last mini-batch's safe point) an active copy waits for its outstanding answer
//! and tells each passive neighbour it is done; a passive copy serves requests until every
//! active neighbour is done. Then the group averages its parameters exactly once (the all-reduce
//! of `every:K`), so the rings deliver one model. No cycle of waits can form: until the end only
//! active copies wait, for nothing; at the end an active copy waits only for a passive one, which
//! answers at its next safe point or in its own end phase, and a passive copy's ring reaches its
//! end without anything from an active one.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use ringtmp_collective::mixing;

/// `micro_batch` of an active copy's parameters sent to a passive one.
pub(crate) const REQUEST: u64 = 0xA12_0000_0000;
/// `micro_batch` of a passive copy's answer (its parameters before averaging).
pub(crate) const ANSWER: u64 = 0xA13_0000_0000;
/// `micro_batch` of an active copy's last message to each passive neighbour (no values).
pub(crate) const DONE: u64 = 0xA14_0000_0000;

/// One stage copy's side of the group's gossip.
pub(crate) struct ReplicaGossip {
    /// Physical ranks of the copies this one exchanges with (passive ones for an active copy,
    /// active ones for a passive copy).
    pub neighbours: Vec<u32>,
    /// Whether this copy starts exchanges.
    pub active: bool,
    /// An active copy starts an exchange after every `every`-th mini-batch (when none is on
    /// its way).
    pub every: u64,
    rng: ChaCha8Rng,
    /// An active copy's exchange on its way: the passive copy, the mini-batch it was sent
    /// after, and what was sent.
    pub outstanding: Option<(u32, u64, Vec<f32>)>,
    /// Exchanges completed (answered requests for a passive copy).
    pub exchanges: u64,
}

impl ReplicaGossip {
    /// The gossip of the copy in ring `ring` of `rings`, stage `stage` of rings of `stages`;
    /// `seed` makes the choice of partners replay.
    pub fn new(ring: u32, rings: u32, stage: u32, stages: u32, seed: u64, every: u64) -> Self {
        let neighbours = mixing::bipartite_neighbours(ring, rings)
            .into_iter()
            .map(|r| r * stages + stage)
            .collect();
        Self {
            neighbours,
            active: ring.is_multiple_of(2),
            every: every.max(1),
            rng: ChaCha8Rng::seed_from_u64(
                seed ^ 0x5EED_0A11_u64.wrapping_mul(u64::from(ring * stages + stage) + 1),
            ),
            outstanding: None,
            exchanges: 0,
        }
    }

    /// The passive copy an active one asks next.
    pub fn pick(&mut self) -> Option<u32> {
        if self.neighbours.is_empty() {
            return None;
        }
        let i = self.rng.random_range(0..self.neighbours.len());
        Some(self.neighbours[i])
    }
}

/// A passive copy's half of an exchange: returns its parameters before averaging (the answer)
/// and replaces them by their mean with the active copy's `request`.
pub(crate) fn answer(params: &mut [f32], request: &[f32]) -> Vec<f32> {
    let before = params.to_vec();
    params
        .iter_mut()
        .zip(request)
        .for_each(|(p, a)| *p = 0.5 * (*p + a));
    before
}

/// An active copy's half: `sent` is what it had sent, `answer` the passive copy's parameters
/// then; adds half their difference to what the copy holds now.
pub(crate) fn apply_answer(params: &mut [f32], sent: &[f32], answer: &[f32]) {
    params
        .iter_mut()
        .zip(sent.iter().zip(answer))
        .for_each(|(p, (a, b))| *p += 0.5 * (b - a));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(copies: &[Vec<f32>]) -> Vec<f64> {
        (0..copies[0].len())
            .map(|i| copies.iter().map(|c| f64::from(c[i])).sum())
            .collect()
    }

    /// Four copies take random steps while exchanges are on their way, in a seeded random
    /// interleaving: the group's sum moves by exactly the steps taken, and with the steps
    /// stopped the copies come together.
    #[test]
    fn gossip_keeps_the_sum_of_the_copies_and_brings_them_together() {
        let rings = 4u32;
        let len = 64;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut copies: Vec<Vec<f32>> = (0..rings)
            .map(|_| (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect())
            .collect();
        let mut gossip: Vec<ReplicaGossip> = (0..rings)
            .map(|r| ReplicaGossip::new(r, rings, 0, 1, 3, 1))
            .collect();
        // Requests waiting at their passive copy: (active, passive, sent).
        let mut requests: Vec<(usize, usize, Vec<f32>)> = Vec::new();
        // Answers on their way back: (active, answer).
        let mut answers: Vec<(usize, Vec<f32>)> = Vec::new();
        let mut expected = sum(&copies);
        for round in 0..4000 {
            let stepping = round < 2000;
            let r = rng.random_range(0..rings as usize);
            match rng.random_range(0..4) {
                0 if stepping => {
                    // A step of copy r.
                    for (i, v) in copies[r].iter_mut().enumerate() {
                        let d = rng.random_range(-0.01..0.01f32);
                        *v += d;
                        expected[i] += f64::from(d);
                    }
                }
                1 if gossip[r].active && gossip[r].outstanding.is_none() => {
                    let to = gossip[r].pick().expect("a neighbour") as usize;
                    gossip[r].outstanding = Some((to as u32, 0, copies[r].clone()));
                    requests.push((r, to, copies[r].clone()));
                }
                2 if !requests.is_empty() => {
                    let (from, to, sent) = requests.remove(rng.random_range(0..requests.len()));
                    let reply = answer(&mut copies[to], &sent);
                    answers.push((from, reply));
                }
                3 if !answers.is_empty() => {
                    let (to, reply) = answers.remove(rng.random_range(0..answers.len()));
                    let (_, _, sent) = gossip[to].outstanding.take().expect("an exchange");
                    apply_answer(&mut copies[to], &sent, &reply);
                }
                _ => {}
            }
            if requests.is_empty() && answers.is_empty() {
                let now = sum(&copies);
                for (a, b) in now.iter().zip(&expected) {
                    assert!((a - b).abs() < 1e-4, "round {round}: sum {a} against {b}");
                }
            }
        }
        let mean: Vec<f64> = expected.iter().map(|s| s / f64::from(rings)).collect();
        let spread = copies
            .iter()
            .flat_map(|c| c.iter().zip(&mean).map(|(v, m)| (f64::from(*v) - m).abs()))
            .fold(0.0f64, f64::max);
        assert!(
            spread < 1e-3,
            "copies still {spread} apart after 2000 rounds without steps"
        );
    }

    #[test]
    fn the_group_graph_is_bipartite_with_even_rings_active() {
        let g = ReplicaGossip::new(0, 4, 1, 3, 0, 1);
        assert!(g.active);
        // Rings 1 and 3 (1 hop either way), stage 1 of rings of 3.
        assert_eq!(g.neighbours, vec![4, 10]);
        let g = ReplicaGossip::new(1, 2, 0, 2, 0, 1);
        assert!(!g.active);
        assert_eq!(g.neighbours, vec![0]);
    }
}
