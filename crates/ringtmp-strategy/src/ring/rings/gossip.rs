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

use ringtmp_transport::TransportError;
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Message, TensorTag};

use super::group_error;
use crate::collective::mixing;

/// `micro_batch` of an active copy's parameters sent to a passive one.
pub(in crate::ring) const REQUEST: u64 = 0xA12_0000_0000;
/// `micro_batch` of a passive copy's answer (its parameters before averaging).
pub(in crate::ring) const ANSWER: u64 = 0xA13_0000_0000;
/// `micro_batch` of an active copy's last message to each passive neighbour (no values).
pub(in crate::ring) const DONE: u64 = 0xA14_0000_0000;

/// One stage copy's side of the group's gossip.
pub(in crate::ring) struct ReplicaGossip {
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
            active: ring % 2 == 0,
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
pub(in crate::ring) fn answer(params: &mut [f32], request: &[f32]) -> Vec<f32> {
    let before = params.to_vec();
    params
        .iter_mut()
        .zip(request)
        .for_each(|(p, a)| *p = 0.5 * (*p + a));
    before
}

/// An active copy's half: `sent` is what it had sent, `answer` the passive copy's parameters
/// then; adds half their difference to what the copy holds now.
pub(in crate::ring) fn apply_answer(params: &mut [f32], sent: &[f32], answer: &[f32]) {
    params
        .iter_mut()
        .zip(sent.iter().zip(answer))
        .for_each(|(p, (a, b))| *p += 0.5 * (b - a));
}

/// The copies' side of the gossip, on the rings' view.
impl super::RingsView<'_> {
    /// Takes the first gossip tensor of kind `tag` (from `from`, if given) out of the inbox.
    pub(super) fn take_gossip(
        &mut self,
        tag: u64,
        from: Option<u32>,
    ) -> Option<(u32, u64, Vec<f32>)> {
        let i = self.group_inbox.iter().position(|(f, m)| {
            from.is_none_or(|x| x == *f)
                && matches!(m, Message::Tensor(h, _) if h.micro_batch == tag)
        })?;
        match self.group_inbox.remove(i) {
            Some((f, Message::Tensor(h, bytes))) => {
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                Some((f, h.step, values))
            }
            _ => None,
        }
    }

    /// Whether `got` may be combined with `params`: the same length, or a sizes-only run's
    /// empty payload (then there is nothing to combine).
    pub(super) fn combinable(
        &self,
        from: u32,
        got: &[f32],
        params: &[f32],
    ) -> Result<bool, TransportError> {
        if got.is_empty() && ringtmp_meter::phantom() {
            return Ok(false);
        }
        if got.len() != params.len() {
            return Err(group_error(self, from, "parameters of the wrong size"));
        }
        Ok(true)
    }

    /// A passive copy answers every request that has arrived.
    pub(super) fn answer_requests(
        &mut self,
        g: &mut ReplicaGossip,
        params: &mut [f32],
    ) -> Result<(), TransportError> {
        while let Some((from, step, request)) = self.take_gossip(REQUEST, None) {
            if !g.neighbours.contains(&from) {
                return Err(group_error(
                    self,
                    from,
                    "a gossip request from a copy that is not a neighbour",
                ));
            }
            let before = if self.combinable(from, &request, params)? {
                answer(params, &request)
            } else {
                Vec::new()
            };
            // (A sizes-only run sends the size without the values.)
            let reply: &[f32] = if before.is_empty() { params } else { &before };
            self.send_group(from, step, ANSWER, TensorTag::Params, reply)?;
            g.exchanges += 1;
        }
        Ok(())
    }

    /// An active copy applies an answer `answer` from `from` to its outstanding exchange.
    pub(super) fn apply(
        &mut self,
        g: &mut ReplicaGossip,
        from: u32,
        answer: &[f32],
        params: &mut [f32],
    ) -> Result<(), TransportError> {
        match g.outstanding.take() {
            Some((peer, _, sent)) if peer == from => {
                if !sent.is_empty() && self.combinable(from, answer, params)? {
                    apply_answer(params, &sent, answer);
                }
                g.exchanges += 1;
                Ok(())
            }
            _ => Err(group_error(self, from, "a gossip answer to no request")),
        }
    }

    /// One safe point of the group's gossip (see [`replica_gossip`]).
    pub(super) fn gossip_round(
        &mut self,
        g: &mut ReplicaGossip,
        step: u64,
        params: &mut [f32],
        last: bool,
    ) -> Result<(), TransportError> {
        let peers = g.neighbours.clone();
        self.poll_group(&peers)?;
        if !g.active {
            self.answer_requests(g, params)?;
            if last {
                self.serve_until_done(g, params)?;
            }
            return Ok(());
        }
        if let Some(peer) = g.outstanding.as_ref().map(|o| o.0)
            && let Some((from, _, answer)) = self.take_gossip(ANSWER, Some(peer))
        {
            self.apply(g, from, &answer, params)?;
        }
        if last {
            if let Some((peer, sent_step)) = g.outstanding.as_ref().map(|o| (o.0, o.1)) {
                let answer = self.group_tensor(peer, sent_step, ANSWER)?;
                self.apply(g, peer, &answer, params)?;
            }
            for &p in &peers {
                self.send_group(p, step, DONE, TensorTag::Params, &[])?;
            }
            return Ok(());
        }
        if g.outstanding.is_none()
            && (step + 1) % g.every == 0
            && let Some(peer) = g.pick()
        {
            self.send_group(peer, step, REQUEST, TensorTag::Params, params)?;
            // A sizes-only run's copy would be empty anyway; it is not kept.
            let sent = if ringtmp_meter::phantom() {
                Vec::new()
            } else {
                params.to_vec()
            };
            g.outstanding = Some((peer, step, sent));
        }
        Ok(())
    }

    /// A passive copy's end: it answers requests until every active neighbour is done. What its
    /// own ring sends meanwhile is put back, in order, for the ring.
    pub(super) fn serve_until_done(
        &mut self,
        g: &mut ReplicaGossip,
        params: &mut [f32],
    ) -> Result<(), TransportError> {
        let mut waiting: Vec<u32> = g.neighbours.clone();
        let mut held: Vec<(u32, Message)> = Vec::new();
        let clock = self.inner.clock();
        let result = (|| {
            while !waiting.is_empty() {
                self.answer_requests(g, params)?;
                while let Some((from, _, _)) = self.take_gossip(DONE, None) {
                    waiting.retain(|p| *p != from);
                }
                if waiting.is_empty() {
                    break;
                }
                // Any group message resets the wait: a slow copy is still training.
                let deadline = clock.now() + self.timeout;
                loop {
                    let left = deadline.saturating_sub(clock.now());
                    let (from, message) = match self.inner.recv(left) {
                        Err(TransportError::Timeout { .. }) => {
                            return Err(TransportError::Timeout {
                                waited: self.timeout,
                                what: "a gossip request or its end".into(),
                                from: waiting
                                    .iter()
                                    .map(|p| self.inner.peer_name(*p).to_string())
                                    .collect::<Vec<_>>()
                                    .join(", "),
                            });
                        }
                        other => other?,
                    };
                    if self.in_ring(from) {
                        held.push((from, message));
                    } else {
                        self.group_inbox.push_back((from, message));
                        break;
                    }
                }
            }
            Ok(())
        })();
        for (from, message) in held.into_iter().rev() {
            self.inner.unread(from, message);
        }
        result
    }
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
