//! The group all-reduce of rings of rings: the copies of a stage (one per ring) average their
//! values with the ring all-reduce of [`ringtmp_collective::ring`] among themselves, stage by
//! stage for a node holding several. Chunks of another ring's re-formation are told apart by
//! their group tag; a copy that waits for a chunk listens to the other rings' masters meanwhile,
//! so a copy that died is replaced by its ring's announcement of who holds its layers now, and
//! the all-reduce starts again under the new tables ([`Interrupt::Regrouped`]).
//!
//! Invariants: every copy sums the chunks in the same fixed order, so the copies end with the
//! same bits; a group tensor that arrives while the ring is being served waits in the view's
//! inbox, and nothing is dropped but the chunks of a group that changed.

use std::time::Duration;

use ringtmp_transport::TransportError;
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Dtype, Message, TensorHeader, TensorTag};

use super::holders::{group_tag, tag_of_group};
use super::{RingsView, group_error};
use ringtmp_collective::ring::chunks;

/// How long a copy waiting for a chunk listens to one peer before it looks for the other rings'
/// announcements of a heal.
pub(super) const POLL: Duration = Duration::from_millis(20);

/// Why a group all-reduce stopped before its end.
pub(super) enum Interrupt {
    /// A ring re-formed: the group's copies start again under the new tables.
    Regrouped,
    /// The all-reduce failed.
    Failed(TransportError),
}

impl From<TransportError> for Interrupt {
    fn from(e: TransportError) -> Self {
        Self::Failed(e)
    }
}

impl RingsView<'_> {
    /// Drops what arrived of stage `unit`'s all-reduce among `group` (a group that changed).
    pub(super) fn drop_chunks_of(&mut self, group: &[u32], unit: u32) {
        self.group_inbox.retain(|(_, m)| match m {
            Message::Tensor(h, _) => !tag_of_group(h.micro_batch, group, unit),
            _ => true,
        });
    }

    /// Chunk `tag` of mini-batch `step` of stage `unit`'s all-reduce among `group` from copy
    /// `from`, or the news that the group changed (stage replicas: a ring re-formed). Meanwhile
    /// the other rings' masters are listened to: a copy that died is replaced by its ring's
    /// announcement, not waited for.
    pub(super) fn chunk_from(
        &mut self,
        from: u32,
        step: u64,
        tag: u64,
        (unit, group): (u32, &[u32]),
    ) -> Result<Vec<f32>, Interrupt> {
        if !self.elastic {
            return Ok(self.group_tensor(from, step, tag)?);
        }
        let clock = self.inner.clock();
        let deadline = clock.now() + self.timeout;
        let masters: Vec<u32> = (0..self.rings)
            .filter(|r| *r != self.ring)
            .map(|r| r * self.stages)
            .collect();
        loop {
            if let Some(values) = self.take_arrived(from, step, tag) {
                return Ok(values);
            }
            if self.take_announcements() && self.holders.group(unit) != group {
                return Err(Interrupt::Regrouped);
            }
            let left = deadline.saturating_sub(clock.now());
            if left.is_zero() {
                return Err(Interrupt::Failed(TransportError::Timeout {
                    waited: self.timeout,
                    what: format!("chunk {tag:#x} of mini-batch {step} of a stage group"),
                    from: self.inner.peer_name(from).to_string(),
                }));
            }
            if !self.dead.contains(&from) {
                match self.inner.recv_from(from, left.min(POLL)) {
                    Ok(message) => {
                        self.group_inbox.push_back((from, message));
                        continue;
                    }
                    Err(TransportError::Timeout { .. }) => {}
                    Err(e) => {
                        if let Some(e) = self.absorb(e) {
                            return Err(Interrupt::Failed(e));
                        }
                    }
                }
            }
            // A heal's announcement comes from its ring's master: while the copy awaited is
            // gone, wait on its ring's master; look at the others' in passing.
            let from_master = from - from % self.stages;
            if self.dead.contains(&from) && self.dead.contains(&from_master) {
                return Err(Interrupt::Failed(TransportError::Io {
                    context: format!(
                        "rings of rings: {}, a copy of stage {unit}, died, and so did its ring's \
                         master, which would have named the node taking its layers over",
                        self.inner.peer_name(from)
                    ),
                    source: std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "a ring's master died",
                    ),
                }));
            }
            for &m in &masters {
                if self.dead.contains(&m) {
                    continue;
                }
                let wait = if m == from_master && self.dead.contains(&from) {
                    left.min(POLL)
                } else {
                    Duration::ZERO
                };
                match self.inner.recv_from(m, wait) {
                    Ok(message) => self.group_inbox.push_back((m, message)),
                    Err(TransportError::Timeout { .. }) => {}
                    Err(e) => {
                        if let Some(e) = self.absorb(e) {
                            return Err(Interrupt::Failed(e));
                        }
                    }
                }
            }
        }
    }

    /// The group tensor `(step, tag)` from physical `from`: from what arrived already, else from
    /// the underlying transport (which keeps the ring's messages for the ring meanwhile).
    pub(super) fn group_tensor(
        &mut self,
        from: u32,
        step: u64,
        tag: u64,
    ) -> Result<Vec<f32>, TransportError> {
        let matches = |m: &Message| matches!(m, Message::Tensor(h, _) if h.step == step && h.micro_batch == tag);
        if let Some(values) = self.take_arrived(from, step, tag) {
            return Ok(values);
        }
        let clock = self.inner.clock();
        let deadline = clock.now() + self.timeout;
        loop {
            let left = deadline.saturating_sub(clock.now());
            let message = self.inner.recv_from(from, left)?;
            if matches(&message)
                && let Message::Tensor(h, bytes) = message
            {
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                return Ok(values);
            }
            // A later all-reduce's tensor from a copy that is ahead: keep it for then.
            self.group_inbox.push_back((from, message));
        }
    }

    /// The group tensor `(step, tag)` from physical `from`, if it already arrived.
    pub(super) fn take_arrived(&mut self, from: u32, step: u64, tag: u64) -> Option<Vec<f32>> {
        let i = self.group_inbox.iter().position(|(f, m)| {
            *f == from
                && matches!(m, Message::Tensor(h, _) if h.step == step && h.micro_batch == tag)
        })?;
        match self.group_inbox.remove(i) {
            Some((_, Message::Tensor(h, bytes))) => {
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                Some(values)
            }
            _ => None,
        }
    }

    /// Moves what the group's `peers` have sent so far into the group inbox, without waiting.
    pub(super) fn poll_group(&mut self, peers: &[u32]) -> Result<(), TransportError> {
        for &p in peers {
            loop {
                match self.inner.recv_from(p, Duration::ZERO) {
                    Ok(message) => self.group_inbox.push_back((p, message)),
                    Err(TransportError::Timeout { .. }) => break,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Sends `data` to copy `to` as group tensor `tag` of mini-batch `step` (empty in a
    /// sizes-only run: the header says the size).
    pub(super) fn send_group(
        &self,
        to: u32,
        step: u64,
        tag: u64,
        kind: TensorTag,
        data: &[f32],
    ) -> Result<(), TransportError> {
        let header = TensorHeader {
            run_id: 0,
            step,
            micro_batch: tag,
            tag: kind,
            dtype: Dtype::F32,
            shape: vec![data.len() as u32],
        };
        let mut bytes = Vec::new();
        ringtmp_wire::message::tensor_bytes_into(data, Dtype::F32, &mut bytes);
        self.inner.send(to, Message::Tensor(header, bytes))
    }

    /// The mean of `values` over the copies of each stage this node holds, stage by stage.
    pub(super) fn mean_over_copies(
        &mut self,
        step: u64,
        values: &mut [f32],
    ) -> Result<(), TransportError> {
        for (unit, range) in self.held(values.len())? {
            self.unit_mean(step, unit, &mut values[range])?;
        }
        Ok(())
    }

    /// The mean of `values` over the copies of stage `unit`; started again, from the same
    /// values, whenever a ring re-forms meanwhile (stage replicas).
    pub(super) fn unit_mean(
        &mut self,
        step: u64,
        unit: u32,
        values: &mut [f32],
    ) -> Result<(), TransportError> {
        let saved = self.elastic.then(|| values.to_vec());
        loop {
            match self.unit_all_reduce(step, unit, values) {
                Ok(()) => return Ok(()),
                Err(Interrupt::Failed(e)) => return Err(e),
                Err(Interrupt::Regrouped) => {
                    if let Some(saved) = &saved {
                        values.copy_from_slice(saved);
                    }
                }
            }
        }
    }

    /// Sends chunk `tag` to copy `to`; under stage replicas a copy in another ring that died
    /// is not an error (its ring's announcement names the copy that replaces it).
    pub(super) fn send_chunk(
        &mut self,
        to: u32,
        step: u64,
        tag: u64,
        chunk: &[f32],
    ) -> Result<(), Interrupt> {
        match self.send_group(to, step, tag, TensorTag::Gradient, chunk) {
            Ok(()) => Ok(()),
            Err(e) => match self.absorb(e) {
                None => Ok(()),
                Some(e) => Err(Interrupt::Failed(e)),
            },
        }
    }

    /// Ring all-reduce among the copies of stage `unit` (reduce-scatter, then all-gather, over
    /// R chunks), then the mean. Every copy adds the same chunks in the same ring order.
    pub(super) fn unit_all_reduce(
        &mut self,
        step: u64,
        unit: u32,
        values: &mut [f32],
    ) -> Result<(), Interrupt> {
        self.take_announcements();
        let group = self.holders.group(unit);
        let result = self.all_reduce_among(step, unit, &group, values);
        if matches!(result, Err(Interrupt::Regrouped)) {
            self.drop_chunks_of(&group, unit);
        }
        result
    }

    pub(super) fn all_reduce_among(
        &mut self,
        step: u64,
        unit: u32,
        group: &[u32],
        values: &mut [f32],
    ) -> Result<(), Interrupt> {
        let n = group.len();
        if n < 2 {
            return Ok(());
        }
        let me = group
            .iter()
            .position(|p| *p == self.inner.rank())
            .unwrap_or(0);
        let (right, left) = (group[(me + 1) % n], group[(me + n - 1) % n]);
        // A sizes-only run's chunks carry no values: nothing to add, copy or scale.
        let phantom = ringtmp_meter::phantom();
        let parts = chunks(values.len(), n);
        // Reduce-scatter: after round k, chunk (me − k − 1) holds k + 2 copies' sum.
        for k in 0..n - 1 {
            let tag = group_tag(group, unit, 0, k);
            let out = (me + n - k) % n;
            let chunk = &values[parts[out].clone()];
            self.send_chunk(right, step, tag, chunk)?;
            let into = (me + n - k - 1) % n;
            let got = self.chunk_from(left, step, tag, (unit, group))?;
            let range = parts[into].clone();
            if phantom && got.is_empty() {
                continue;
            }
            if got.len() != range.len() {
                return Err(group_error(self, left, "a chunk of the wrong size").into());
            }
            values[range]
                .iter_mut()
                .zip(&got)
                .for_each(|(v, g)| *v += g);
        }
        // All-gather: chunk (me + 1) is complete here; pass the complete chunks round.
        for k in 0..n - 1 {
            let tag = group_tag(group, unit, 1, k);
            let out = (me + 1 + n - k) % n;
            let chunk = &values[parts[out].clone()];
            self.send_chunk(right, step, tag, chunk)?;
            let into = (me + n - k) % n;
            let got = self.chunk_from(left, step, tag, (unit, group))?;
            let range = parts[into].clone();
            if phantom && got.is_empty() {
                continue;
            }
            if got.len() != range.len() {
                return Err(group_error(self, left, "a chunk of the wrong size").into());
            }
            values[range].copy_from_slice(&got);
        }
        if !phantom {
            let scale = 1.0 / n as f32;
            values.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use ringtmp_transport::Transport;
    use ringtmp_transport::sim::{SimConfig, SimNetwork};

    use super::RingsView;
    use crate::net::RingNet;

    /// Every node's starting values: different in every rank, not exactly representable sums.
    fn start(rank: u32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (rank as f32 + 1.0) * 0.37 + i as f32 * 0.011)
            .collect()
    }

    /// Runs the group all-reduce of one mini-batch on rings of `stages` nodes, `rings` of them,
    /// over a seeded simulated network; returns each rank's values after it.
    fn reduce(stages: u32, rings: u32, len: usize, seed: u64) -> Vec<Vec<f32>> {
        let world = stages * rings;
        let links: Vec<BTreeSet<u32>> = (0..world)
            .map(|r| (0..world).filter(|p| *p != r).collect())
            .collect();
        let mut config = SimConfig::new(seed);
        config.jitter = Duration::from_micros(700);
        let net = SimNetwork::new(config, links);
        net.run(|mut node| {
            let rank = node.rank();
            let mut values = start(rank, len);
            let mut view = RingsView::new(&mut node, stages, rings, Duration::from_secs(5));
            let reduced = view.average_with_replicas(0, &mut values);
            reduced.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            drop(view);
            // A node that is done says goodbye: the others' reductions may still be running.
            node.close()
                .unwrap_or_else(|e| panic!("rank {rank} closing: {e}"));
            values
        })
    }

    #[test]
    fn the_copies_of_each_stage_end_with_their_mean_bit_for_bit() {
        // Lengths that the group does not divide, and fewer values than copies.
        for (stages, rings, len, seed) in [(2, 3, 37, 7), (3, 2, 10, 8), (1, 4, 3, 9)] {
            let out = reduce(stages, rings, len, seed);
            for s in 0..stages {
                let group: Vec<usize> = (0..rings).map(|r| (r * stages + s) as usize).collect();
                let first = &out[group[0]];
                for &g in &group {
                    // The same bits in every copy: the rings stay identical.
                    assert_eq!(&out[g], first, "stage {s}, rank {g}");
                }
                for (i, got) in first.iter().enumerate() {
                    let mean = group
                        .iter()
                        .map(|&g| f64::from(start(g as u32, len)[i]))
                        .sum::<f64>()
                        / f64::from(rings);
                    assert!(
                        (f64::from(*got) - mean).abs() < 1e-5,
                        "stage {s}, value {i}: {got} vs {mean}"
                    );
                }
            }
        }
    }
}
