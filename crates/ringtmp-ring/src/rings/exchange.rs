//! The copies' side of rings of rings' gossip (`--replica-sync adpsgd`) on the rings' view: at
//! each safe point a passive copy answers the requests that have arrived, an active copy applies
//! the answer it awaits and starts its next exchange, and at the end the copies release one
//! another (the rules, and why they cannot deadlock, are [`super::gossip`]'s).
//!
//! Invariant: a copy's parameters change only by an answer's half difference (or, passive, by
//! the average with the request), so the group's sum changes only by its copies' own steps.

use ringtmp_transport::TransportError;
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Message, TensorTag};

use super::gossip::{ANSWER, DONE, REQUEST, ReplicaGossip, answer, apply_answer};
use super::{RingsView, group_error};

impl RingsView<'_> {
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
            && (step + 1).is_multiple_of(g.every)
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
