//! Rings of rings (`--strategy ring --replicas R`): R rings of S nodes train side by side, as
//! PipeDream and Megatron combine pipeline and data parallelism. Physical rank `r·S + s` is stage
//! `s` of ring `r`; ring `r`'s master (`r·S`) holds the data and labels of its share of every
//! global batch (R × the batch), and the copies of a stage in the R rings — its *group* — average
//! their gradients before every step with a ring all-reduce among themselves, so every ring's
//! stage steps with the same mean and the rings stay identical: with a synchronous schedule, R
//! rings of batch b compute what one ring (or one process) of batch R·b does.
//!
//! The ring code runs unchanged on [`RingsView`], which numbers its ring's nodes 0…S−1 and does
//! the group's all-reduce in [`Transport::average_with_replicas`]. Messages of the group that
//! arrive while the ring is being served (a faster copy already reducing) wait in the view for
//! the all-reduce, and the ring's messages that arrive during an all-reduce stay with the
//! underlying transport for the ring; nothing is dropped.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use ringtmp_transport::{Clock, LinkStats, PeerName, Transport, TransportError};
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Dtype, Message, TensorHeader, TensorTag};

use crate::allreduce::ring::chunks;

/// `micro_batch` of the all-reduce's tensors: this marker, the phase (0 reduce-scatter, 1
/// all-gather) at bit 16 and the round below.
const GROUP: u64 = 0xA11_0000_0000;

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
        }
    }

    fn physical(&self, k: u32) -> u32 {
        self.ring * self.stages + k
    }

    /// Physical ranks of this node's group, ring order.
    fn group(&self) -> Vec<u32> {
        let stage = self.inner.rank() % self.stages;
        (0..self.rings).map(|r| r * self.stages + stage).collect()
    }

    /// Whether physical `p` is in this node's ring.
    fn in_ring(&self, p: u32) -> bool {
        p / self.stages == self.ring
    }

    /// The group tensor `(step, tag)` from physical `from`: from what arrived already, else from
    /// the underlying transport (which keeps the ring's messages for the ring meanwhile).
    fn group_tensor(&mut self, from: u32, step: u64, tag: u64) -> Result<Vec<f32>, TransportError> {
        let matches = |m: &Message| matches!(m, Message::Tensor(h, _) if h.step == step && h.micro_batch == tag);
        if let Some(i) = self
            .group_inbox
            .iter()
            .position(|(f, m)| *f == from && matches(m))
        {
            if let Some((_, Message::Tensor(h, bytes))) = self.group_inbox.remove(i) {
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                return Ok(values);
            }
        }
        let clock = self.inner.clock();
        let deadline = clock.now() + self.timeout;
        loop {
            let left = deadline.saturating_sub(clock.now());
            let message = self.inner.recv_from(from, left)?;
            if matches(&message) {
                if let Message::Tensor(h, bytes) = message {
                    let mut values = Vec::new();
                    tensor_values(&bytes, h.dtype, &mut values);
                    return Ok(values);
                }
            }
            // A later all-reduce's tensor from a copy that is ahead: keep it for then.
            self.group_inbox.push_back((from, message));
        }
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
        self.inner.send(self.physical(to), message)
    }

    fn recv(&mut self, wait: Duration) -> Result<(u32, Message), TransportError> {
        let clock = self.inner.clock();
        let deadline = clock.now() + wait;
        loop {
            let left = deadline.saturating_sub(clock.now());
            let (from, message) = self.inner.recv(left)?;
            if self.in_ring(from) {
                return Ok((from % self.stages, message));
            }
            self.group_inbox.push_back((from, message));
        }
    }

    fn try_recv(&mut self) -> Result<Option<(u32, Message)>, TransportError> {
        loop {
            match self.inner.try_recv()? {
                None => return Ok(None),
                Some((from, message)) if self.in_ring(from) => {
                    return Ok(Some((from % self.stages, message)));
                }
                Some((from, message)) => self.group_inbox.push_back((from, message)),
            }
        }
    }

    fn recv_from(&mut self, from: u32, wait: Duration) -> Result<Message, TransportError> {
        self.inner.recv_from(self.physical(from), wait)
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

    /// Ring all-reduce among the copies of this stage (reduce-scatter, then all-gather, over
    /// R chunks), then the mean. Every copy adds the same chunks in the same ring order.
    fn average_with_replicas(
        &mut self,
        step: u64,
        values: &mut [f32],
    ) -> Result<(), TransportError> {
        let group = self.group();
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
        let send = |this: &Self, tag: u64, data: &[f32]| {
            let header = TensorHeader {
                run_id: 0,
                step,
                micro_batch: tag,
                tag: TensorTag::Gradient,
                dtype: Dtype::F32,
                shape: vec![data.len() as u32],
            };
            let mut bytes = Vec::new();
            // (Empty in a sizes-only run: the header says the size.)
            ringtmp_wire::message::tensor_bytes_into(data, Dtype::F32, &mut bytes);
            this.inner.send(right, Message::Tensor(header, bytes))
        };
        // Reduce-scatter: after round k, chunk (me − k − 1) holds k + 2 copies' sum.
        for k in 0..n - 1 {
            let out = (me + n - k) % n;
            send(self, GROUP | k as u64, &values[parts[out].clone()])?;
            let into = (me + n - k - 1) % n;
            let got = self.group_tensor(left, step, GROUP | k as u64)?;
            let range = parts[into].clone();
            if phantom && got.is_empty() {
                continue;
            }
            if got.len() != range.len() {
                return Err(group_error(self, left, "a chunk of the wrong size"));
            }
            values[range]
                .iter_mut()
                .zip(&got)
                .for_each(|(v, g)| *v += g);
        }
        // All-gather: chunk (me + 1) is complete here; pass the complete chunks round.
        for k in 0..n - 1 {
            let tag = GROUP | 1 << 16 | k as u64;
            let out = (me + 1 + n - k) % n;
            send(self, tag, &values[parts[out].clone()])?;
            let into = (me + n - k) % n;
            let got = self.group_tensor(left, step, tag)?;
            let range = parts[into].clone();
            if phantom && got.is_empty() {
                continue;
            }
            if got.len() != range.len() {
                return Err(group_error(self, left, "a chunk of the wrong size"));
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
    job: &super::driver::RingJob,
    rank: u32,
    cx: &mut crate::job::NodeCx<'_>,
) -> crate::Result<Option<ringtmp_metrics::Summary>> {
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
    if stage != 0 {
        super::driver::run_worker(&job, &mut view)?;
        return Ok(None);
    }
    let setup = super::driver::MasterSetup {
        data: data
            .ok_or_else(|| crate::Error::Config("a ring's master needs the dataset".into()))?,
    };
    let mut quiet = |_: &crate::Event| {};
    let on_event: &mut dyn FnMut(&crate::Event) = if ring == 0 { cx.on_event } else { &mut quiet };
    let summary = super::driver::run_master(&job, &setup, &mut view, on_event)?.summary;
    drop(view);
    if ring > 0 {
        let text = serde_json::to_string(&summary)
            .map_err(|e| crate::Error::Config(format!("encoding the ring's summary: {e}")))?;
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
        let report = match cx.net.recv_from(r * stages, timeout)? {
            ringtmp_wire::Message::Control(Control::Report { nodes }) if nodes.len() == 1 => {
                serde_json::from_str::<ringtmp_metrics::Summary>(&nodes[0]).map_err(|e| {
                    crate::Error::Config(format!("ring {r}'s summary is not valid: {e}"))
                })?
            }
            _ => {
                return Err(crate::Error::protocol(
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
    }
    total.nodes = stages * rings;
    total.samples_per_second = total.samples as f64 / total.train_seconds.max(1e-9);
    total.bytes_per_sample = training_bytes / total.samples.max(1) as f64;
    let path = job.spec.out.join("summary.json");
    let text = serde_json::to_string_pretty(&total)
        .map_err(|e| crate::Error::Config(format!("encoding the summary: {e}")))?;
    ringtmp_model::checkpoint::write_atomic(&path, text.as_bytes())?;
    Ok(Some(total))
}
