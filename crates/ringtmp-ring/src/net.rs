//! What a ring's node asks of its network beyond messages: the hooks through which rings of
//! rings average, gossip and re-form a stage's copies across rings. A plain network has no
//! copies ([`Plain`]: every hook does nothing); the rings-of-rings view
//! ([`crate::rings::RingsView`]) implements them, and the heal's view of a re-formed ring
//! ([`crate::heal::Members`]) hands them to the network under it.
//!
//! Kept out of [`Transport`], which every strategy and the runtime use: these are the ring's.

use std::sync::Arc;
use std::time::Duration;

use ringtmp_transport::{BufferPool, Clock, LinkStats, PeerName, Transport, TransportError};
use ringtmp_wire::Message;

/// A ring node's network: messages ([`Transport`]) and the rings-of-rings hooks.
pub trait RingNet: Transport {
    /// Rings of rings: replaces `values` (a stage's gradients after mini-batch `step`) by their
    /// mean over the copies of this node's stage in the other rings, before the optimizer step.
    /// A node that has no such copies (every network but a ring-of-rings view) has nothing
    /// to do.
    fn average_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
    ) -> Result<(), TransportError> {
        let _ = (step, values);
        Ok(())
    }
    /// Rings of rings under `--replica-sync adpsgd`: the safe point after mini-batch `step`,
    /// where the copies of this node's stage exchange parameters (`values`) asynchronously;
    /// after the `last` mini-batch the copies finish their exchanges and average once. A node
    /// without copies has nothing to do.
    fn gossip_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
        last: bool,
    ) -> Result<(), TransportError> {
        let _ = (step, values, last);
        Ok(())
    }
    /// Rings of rings with stage replicas: this node's ring re-formed in `generation` as
    /// `members` (its nodes' ranks in the ring as it started, ring order). The view learns
    /// which node of the ring now holds each stage; the ring's master tells the other rings.
    /// A node without copies has nothing to do.
    fn ring_regrouped(&mut self, generation: u64, members: &[u32]) -> Result<(), TransportError> {
        let _ = (generation, members);
        Ok(())
    }
    /// Rings of rings under `--replica-sync diloco:H` with stage replicas: the outer momentum of
    /// the layers this node holds, for a replication snapshot taken right after an outer step
    /// (its outer parameters are then the stage's own). Empty where there is none.
    fn replica_outer_state(&self) -> Vec<f32> {
        Vec::new()
    }
    /// The other half of [`RingNet::replica_outer_state`]: after a heal, the outer state of
    /// the layers this node now holds, from the restored snapshot's parameters and outer
    /// momentum.
    fn restore_outer_state(
        &mut self,
        params: &[f32],
        velocity: &[f32],
    ) -> Result<(), TransportError> {
        let _ = (params, velocity);
        Ok(())
    }
}

/// A ring node's context: its network with the ring's hooks, its data, where progress goes.
pub struct RingCx<'a> {
    /// Its links, with the rings-of-rings hooks.
    pub net: &'a mut dyn RingNet,
    /// The dataset, on the rank that reads it (the master).
    pub data: Option<&'a ringtmp_data::Dataset>,
    /// Where progress goes.
    pub on_event: &'a mut dyn FnMut(&ringtmp_contract::Event),
}

impl<'a> RingCx<'a> {
    /// The dataset; an error naming the rank when the node was started without it.
    pub fn data(&self) -> ringtmp_contract::Result<&'a ringtmp_data::Dataset> {
        self.data.ok_or_else(|| {
            ringtmp_contract::Error::Config(format!(
                "rank {} needs the dataset but was started without it",
                self.net.rank()
            ))
        })
    }
}

/// A network without copies of this node's stage in other rings: every hook does nothing.
pub struct Plain<'a>(pub &'a mut dyn Transport);

impl RingNet for Plain<'_> {}

impl Transport for Plain<'_> {
    fn rank(&self) -> u32 {
        self.0.rank()
    }
    fn peers(&self) -> Vec<u32> {
        self.0.peers()
    }
    fn peer_name(&self, rank: u32) -> PeerName {
        self.0.peer_name(rank)
    }
    fn send(&self, to: u32, message: Message) -> Result<(), TransportError> {
        self.0.send(to, message)
    }
    fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError> {
        self.0.recv(wait)
    }
    fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError> {
        self.0.try_recv()
    }
    fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError> {
        self.0.recv_from(from, wait)
    }
    fn unread(&mut self, from: u32, message: Message) {
        self.0.unread(from, message)
    }
    fn buffers(&self) -> &BufferPool {
        self.0.buffers()
    }
    fn stats(&self) -> Vec<LinkStats> {
        self.0.stats()
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }
    fn close(&mut self) -> Result<(), TransportError> {
        self.0.close()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        self.0.clock()
    }
    fn watch_steps(&mut self, bound: ringtmp_transport::StepBound) {
        self.0.watch_steps(bound)
    }
    fn step_done(&mut self) {
        self.0.step_done()
    }
}
