//! A non-master node of a ring: its stage, one loop under every schedule (the [`StagePolicy`]
//! decides), and what it serves besides (evaluation passes, its checkpoint file, its report).

use std::collections::VecDeque;
use std::time::Duration;

use ringtmp_model::{Optimizer, Pass, Stage};
use ringtmp_transport::Transport;
use ringtmp_wire::message::tensor_values;
use ringtmp_wire::{Control, Dtype, Message, TensorHeader, TensorTag};

use crate::heal::replicas::{REPLICA, Replicas, Snapshot};
use crate::net::RingNet;
use crate::plan::partition::StagePlan;
use crate::run::driver::{
    NodeClock, RingJob, micro_offset, node_summary, protocol, tensor, values,
};
use crate::run::messages::{Incoming, RingMessage};
use crate::run::schedule::{Action, Schedule, StagePolicy};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;

/// Messages a node keeps while it waits for a clipping message; more means the protocol broke.
const MAX_EARLY: usize = 64;

/// Runs a non-master node: its stage, driven by what arrives, until the final report passes.
/// One loop for every schedule: the [`StagePolicy`] decides what to do next and which tensors
/// belong to the work in progress; this loop moves the messages and runs the compute. Arrived
/// messages are taken first whenever there is work to do, so the policy decides on everything
/// that is there. Returns the stage (its final parameters).
pub fn run_worker(job: &RingJob, net: &mut dyn RingNet) -> Result<Stage> {
    run_worker_with(job, net, None, &mut Replicas::default())
}

/// [`run_worker`] from `initial` (a healed ring's in-memory state) instead of the job's start or
/// checkpoint, keeping replication snapshots in `replicas` (`--stage-replicas`).
pub fn run_worker_with(
    job: &RingJob,
    net: &mut dyn RingNet,
    initial: Option<&Snapshot>,
    replicas: &mut Replicas,
) -> Result<Stage> {
    let mut node = RingNode::new(job, net, job.schedule == Schedule::Async, initial)?;
    let (rank, n) = (node.rank as usize, job.partition.len());
    let mut policy = StagePolicy::new(
        job.schedule,
        (rank, n),
        job.micro_batches,
        job.async_window(),
        job.first_step(),
    );
    let m = job.micro_batches.max(1) as u64;
    let mut work = Work::default();
    loop {
        policy.follow_drains(|k| job.next_drain(k / m) * m);
        let action = policy.next(!work.inputs.is_empty(), !work.grads.is_empty());
        // Messages that came while the node waited for a clipping message go first.
        let arrived = match node.early.pop_front() {
            Some(message) => Some(message),
            None if action.is_some() => net.try_recv()?,
            None => None,
        };
        match if arrived.is_some() { None } else { action } {
            Some(Action::Forward) => {
                let (id, rows, x) = work.inputs.pop_front().expect("next() saw an input");
                let at = policy.forward_at(id);
                node.forward(
                    job,
                    net,
                    (at.header_step, at.id),
                    at.step,
                    at.micro,
                    rows,
                    &x,
                )?;
                policy.record(Action::Forward, id);
            }
            Some(Action::Backward) => {
                let (id, dy) = work.grads.pop_front().expect("next() saw a gradient");
                // A backward that completes a step takes it layer by layer, unless the gradients
                // must first be averaged with the stage's copies (rings of rings).
                let mut probe = policy;
                let closes = probe
                    .record(Action::Backward, id)
                    .filter(|_| !job.averages_gradients() && job.spec.clip_grad_norm.is_none());
                let header = policy.backward_step(id);
                node.backward(job, net, id, header, &dy, closes)?;
                if let Some(step) = policy.record(Action::Backward, id) {
                    if closes.is_none() {
                        node.step(job, net, step)?;
                    }
                    // Async steps every micro-batch; a mini-batch ends with its last one.
                    let minibatch_done = job.schedule != Schedule::Async || (id + 1) % m == 0;
                    if minibatch_done {
                        job.after_minibatch(net, step, node.stage.params_mut())?;
                    }
                }
            }
            None => {
                if receive(&mut node, job, net, &policy, arrived, &mut work, replicas)? {
                    return Ok(node.stage);
                }
            }
        }
    }
}

/// What a stage node has received and not yet worked on: activations (micro-batch, rows,
/// values) and gradients (micro-batch, values), in arrival order.
#[derive(Default)]
struct Work {
    inputs: VecDeque<(u64, usize, Vec<f32>)>,
    grads: VecDeque<(u64, Vec<f32>)>,
}

/// Takes one message (`arrived`, or the next within the job's timeout) and acts on it: work is
/// queued, clipping norms, replicas and replication rounds are handled, a regroup order is
/// returned as its error. Returns whether the run is over for this node (the final report
/// passed).
fn receive(
    node: &mut RingNode,
    job: &RingJob,
    net: &mut dyn RingNet,
    policy: &StagePolicy,
    arrived: Option<(u32, Message)>,
    work: &mut Work,
    replicas: &mut Replicas,
) -> Result<bool> {
    let (inputs, grads) = (&mut work.inputs, &mut work.grads);
    let timeout = job.recv_timeout();
    match arrived
        .map_or_else(|| node.clock.recv(net, timeout), Ok)
        .and_then(|(from, m)| Ok((from, Incoming::read(m, net, from)?)))?
    {
        (from, Incoming::Wire(Message::Tensor(h, bytes)))
            if from == node.pred && h.tag == TensorTag::Activation && policy.accepts(h.step) =>
        {
            let rows = h.shape.first().copied().unwrap_or(0) as usize;
            inputs.push_back((h.micro_batch, rows, values(&bytes, h.dtype)));
        }
        (from, Incoming::Wire(Message::Tensor(h, bytes)))
            if from == node.succ && h.tag == TensorTag::Gradient && policy.accepts(h.step) =>
        {
            grads.push_back((h.micro_batch, values(&bytes, h.dtype)));
        }
        // Gradient clipping: the successor finished its part of the step's norm before
        // this stage's last backward did.
        (
            from,
            Incoming::Own(RingMessage::GradNorm {
                step,
                sum_squares_bits,
            }),
        ) if from == node.succ
            && job.spec.clip_grad_norm.is_some()
            && policy.accepts(step)
            && node.grad_norm.is_none() =>
        {
            node.grad_norm = Some((step, f64::from_bits(sum_squares_bits)));
        }
        // Stage replicas: the successor's snapshot, then its token (same link, so in
        // this order); the master's re-formation of the ring.
        (from, Incoming::Wire(Message::Tensor(h, bytes)))
            if from == node.succ && h.tag == TensorTag::Params && h.micro_batch == REPLICA =>
        {
            let next = &job.partition[node.succ as usize];
            let layers = job.layers()?;
            let snapshot = Snapshot::from_values(
                h.step,
                next.start..next.end,
                &layers,
                &job.spec.optimizer,
                node.optimizer.steps(),
                &values(&bytes, h.dtype),
            )
            .ok_or_else(|| protocol(net, from, "replica of the wrong size"))?;
            replicas.keep_succ(snapshot);
        }
        // A replication round: the master's order reaches every node at once; each sends
        // its snapshot to its predecessor, and tells the master once its successor's
        // snapshot is in (the successor's token follows it on the same link). The last
        // node's successor is the master, whose stage is not replicated.
        (0, Incoming::Own(RingMessage::Replicate { step })) if node.succ == 0 => {
            node.replicate(net, step, replicas)?;
            net.send(0, RingMessage::Replicate { step }.to_message())?;
        }
        (0, Incoming::Own(RingMessage::Replicate { step })) => {
            node.replicate(net, step, replicas)?;
        }
        (from, Incoming::Own(RingMessage::Replicate { step })) if from == node.succ => {
            net.send(0, RingMessage::Replicate { step }.to_message())?;
        }
        (
            0,
            Incoming::Wire(Message::Control(Control::Regroup {
                generation,
                members,
                step,
                ..
            })),
        ) => {
            return Err(Error::Regroup {
                generation,
                members,
                step,
            });
        }
        (
            from,
            Incoming::Wire(
                message @ (Message::Tensor(
                    TensorHeader {
                        tag: TensorTag::Inference,
                        ..
                    },
                    _,
                )
                | Message::Control(Control::Checkpoint { .. } | Control::Report { .. })),
            ),
        ) => {
            if node.serve(job, net, from, message)? {
                return Ok(true);
            }
        }
        (from, incoming) => return Err(protocol(net, from, &incoming.describe())),
    }
    Ok(false)
}

/// A non-master node, as both of its loops (flushed schedules and async) use it: its stage and
/// optimizer, neighbours and clocks; the forward, backward and step of its schedule; and what it
/// does besides (forward evaluation passes, write its checkpoint file, add its report at the end).
struct RingNode {
    rank: u32,
    succ: u32,
    pred: u32,
    stage: Stage,
    optimizer: Optimizer,
    plan: StagePlan,
    clock: NodeClock,
    started: Duration,
    /// What activations and gradients travel as.
    wire: Dtype,
    /// Messages that arrived while the node waited for one of gradient clipping's (a master's
    /// order to replicate, say), for the main loop to take first.
    early: VecDeque<(u32, Message)>,
    /// Gradient clipping: the successor's summed squared norm of a mini-batch, which may arrive
    /// before this stage's own last backward.
    grad_norm: Option<(u64, f64)>,
}

impl RingNode {
    /// This node's stage (loaded from the job's checkpoint when resuming), its neighbours and
    /// clocks; `stashing` keeps a weight version per micro-batch in flight (async).
    fn new(
        job: &RingJob,
        net: &dyn Transport,
        stashing: bool,
        initial: Option<&Snapshot>,
    ) -> Result<Self> {
        let rank = net.rank();
        let n = job.partition.len() as u32;
        let (mut stage, plan) = job.stage(rank)?;
        stage.set_input_grad(true);
        stage.set_weight_stashing(stashing);
        let mut optimizer = Optimizer::new(job.spec.optimizer.clone(), stage.params().len());
        match initial {
            Some(snapshot) => snapshot.restore(&mut stage, &mut optimizer)?,
            None => job.load(&mut stage, &mut optimizer)?,
        }
        Ok(Self {
            rank,
            succ: (rank + 1) % n,
            pred: (rank + n - 1) % n,
            stage,
            optimizer,
            plan,
            clock: NodeClock::new(
                net,
                job.node_speeds.get(rank as usize).copied().unwrap_or(1.0),
            ),
            started: net.clock().now(),
            wire: job.spec.wire_dtype,
            early: VecDeque::new(),
            grad_norm: None,
        })
    }

    /// Forward of stage micro-batch `header.1` (`micro`-th of mini-batch `step`, which seeds its
    /// dropout and places its rows) and sends the activation on with `header` as (step, micro-batch).
    fn forward(
        &mut self,
        job: &RingJob,
        net: &mut dyn RingNet,
        header: (u64, u64),
        step: u64,
        micro: usize,
        rows: usize,
        x: &[f32],
    ) -> Result<()> {
        let (header_step, id) = header;
        let pass = Pass {
            train: true,
            seed: job.spec.seed,
            step,
            row_offset: micro_offset(job, micro),
        };
        let stage = &mut self.stage;
        let out = self
            .clock
            .run(|| stage.forward(id, x, rows, &pass).map(<[f32]>::to_vec))?;
        self.clock.peak_stash = self.clock.peak_stash.max(self.stage.stash_bytes());
        net.send(
            self.succ,
            tensor(
                TensorTag::Activation,
                header_step,
                id,
                rows,
                &out,
                self.wire,
            ),
        )?;
        Ok(())
    }

    /// Backward of stage micro-batch `id`; sends the input gradient back tagged
    /// (`header_step`, `id`) before the weight gradients ([`Stage::backward_sending`]). With
    /// `step`, the backward completes that mini-batch's gradients and takes its optimizer step
    /// on the way.
    fn backward(
        &mut self,
        job: &RingJob,
        net: &mut dyn RingNet,
        id: u64,
        header_step: u64,
        dy: &[f32],
        step: Option<u64>,
    ) -> Result<()> {
        let Self {
            stage,
            optimizer,
            clock,
            pred,
            wire,
            ..
        } = self;
        let input_len = stage.input_len().max(1);
        // The input gradient goes to the predecessor as soon as it is complete, and the weight
        // gradients and updates follow while it travels and the predecessor starts its own
        // backward: the ring's backward chain waits for no weight gradient.
        let mut sent = None;
        let mut lap = clock.lap();
        let computed = stage.backward_sending(
            id,
            dy,
            step.map(|step| (&mut *optimizer, job.lr_at(step))),
            &mut || {},
            &mut |dx| {
                clock.settle(&mut lap);
                // From the input gradient, which the stage sizes itself: a phantom run's `dy`
                // (sizes only, `ringtmp_meter`) may have arrived empty.
                let rows = dx.len() / input_len;
                let gradient = tensor(TensorTag::Gradient, header_step, id, rows, dx, *wire);
                sent = Some(net.send(*pred, gradient));
                // Sending is not compute.
                lap = clock.lap();
            },
        );
        clock.settle(&mut lap);
        computed?;
        sent.expect("input gradients are on for non-master stages")?;
        Ok(())
    }

    /// A replication round reached this node (from its successor): keep a snapshot of its own
    /// state, send it to the predecessor, then pass the token on behind it.
    fn replicate(
        &mut self,
        net: &mut dyn RingNet,
        step: u64,
        replicas: &mut Replicas,
    ) -> Result<()> {
        let snapshot = Snapshot::take(
            step,
            self.plan.start..self.plan.end,
            &self.stage,
            &self.optimizer,
        )
        .with_outer_velocity(net.replica_outer_state());
        let message = tensor(
            TensorTag::Params,
            step,
            REPLICA,
            1,
            &snapshot.to_values(),
            Dtype::F32,
        );
        replicas.bytes_sent += ringtmp_wire::declared_len(&message) as u64;
        replicas.keep_own(snapshot);
        net.send(self.pred, message)?;
        net.send(self.pred, RingMessage::Replicate { step }.to_message())?;
        Ok(())
    }

    /// The optimizer step of mini-batch `step`.
    fn step(&mut self, job: &RingJob, net: &mut dyn RingNet, step: u64) -> Result<()> {
        let lr = job.lr_at(step);
        // Rings of rings average the stage's gradients with its copies first (flushed
        // schedules: one step per mini-batch, the same on every copy).
        if job.averages_gradients() {
            net.average_with_replicas(step, self.stage.grads_mut())?;
        }
        if job.spec.clip_grad_norm.is_some() {
            self.clip(job, net, step)?;
        }
        let (stage, optimizer) = (&mut self.stage, &mut self.optimizer);
        self.clock.run(|| stage.step(optimizer, lr));
        Ok(())
    }

    /// Gradient clipping by the global norm (flushed schedules; see the master's half,
    /// `clip_from_master`): adds this stage's squared norm to its successor's sum (the last stage
    /// starts it) and passes it back towards the master, then takes the factor the master sends
    /// around, passes it on and scales the gradient by it.
    fn clip(&mut self, job: &RingJob, net: &mut dyn RingNet, step: u64) -> Result<()> {
        let stage = &mut self.stage;
        let own = self.clock.run(|| stage.grad_norm_squared());
        let later = if self.succ == 0 {
            0.0
        } else if let Some((s, sum)) = self.grad_norm.take() {
            if s != step {
                return Err(protocol(
                    net,
                    self.succ,
                    &format!("gradient norm of step {s} during step {step}"),
                ));
            }
            sum
        } else {
            let from = self.succ;
            self.wait_for(job, net, from, |m| match m {
                RingMessage::GradNorm {
                    step: s,
                    sum_squares_bits,
                } if *s == step => Some(f64::from_bits(*sum_squares_bits)),
                _ => None,
            })?
        };
        net.send(
            self.pred,
            RingMessage::GradNorm {
                step,
                sum_squares_bits: (own + later).to_bits(),
            }
            .to_message(),
        )?;
        let from = self.pred;
        let factor = self.wait_for(job, net, from, |m| match m {
            RingMessage::ClipScale {
                step: s,
                factor_bits,
            } if *s == step => Some(f32::from_bits(*factor_bits)),
            _ => None,
        })?;
        if self.succ != 0 {
            net.send(
                self.succ,
                RingMessage::ClipScale {
                    step,
                    factor_bits: factor.to_bits(),
                }
                .to_message(),
            )?;
        }
        let stage = &mut self.stage;
        self.clock.run(|| stage.scale_grads(factor));
        Ok(())
    }

    /// Receives until `from` sends the control message `accept` takes, keeping anything else for
    /// the main loop (within the job's receive timeout for each message, naming the peer).
    fn wait_for<T>(
        &mut self,
        job: &RingJob,
        net: &mut dyn RingNet,
        from: u32,
        accept: impl Fn(&RingMessage) -> Option<T>,
    ) -> Result<T> {
        loop {
            let (sender, message) = self.clock.recv(net, job.recv_timeout())?;
            if sender == from
                && let Message::Control(control) = &message
                && let Some(own) = RingMessage::from_control(control, net, sender)?
                && let Some(value) = accept(&own)
            {
                return Ok(value);
            }
            if self.early.len() >= MAX_EARLY {
                return Err(protocol(
                    net,
                    sender,
                    &format!(
                        "{} while waiting for rank {from}'s clipping message",
                        message.describe()
                    ),
                ));
            }
            self.early.push_back((sender, message));
        }
    }

    /// Handles an evaluation chunk, a checkpoint or the final report from the predecessor;
    /// returns `true` when the run is over for this node. Anything else is a protocol error.
    fn serve(
        &mut self,
        job: &RingJob,
        net: &mut dyn RingNet,
        from: u32,
        message: Message,
    ) -> Result<bool> {
        if from != self.pred {
            return Err(protocol(net, from, "message"));
        }
        match message {
            Message::Tensor(h, bytes) if h.tag == TensorTag::Inference => {
                let rows = h.shape.first().copied().unwrap_or(0) as usize;
                let mut values = Vec::new();
                tensor_values(&bytes, h.dtype, &mut values);
                let out = self.stage.infer(&values, rows)?.to_vec();
                let message = tensor(
                    TensorTag::Inference,
                    h.step,
                    h.micro_batch,
                    rows,
                    &out,
                    Dtype::F32,
                );
                self.clock.eval_bytes += ringtmp_wire::declared_len(&message) as u64;
                net.send(self.succ, message)?;
                Ok(false)
            }
            Message::Control(Control::Checkpoint { step, mut files }) => {
                files.push(job.write_stage_file(self.rank, step, &self.stage, &self.optimizer)?);
                net.send(
                    self.succ,
                    Message::Control(Control::Checkpoint { step, files }),
                )?;
                Ok(false)
            }
            Message::Control(Control::Report { mut nodes }) => {
                let stats = net.stats();
                let own = node_summary(
                    self.rank,
                    "stage",
                    &self.stage,
                    &self.optimizer,
                    &self.plan,
                    &self.clock,
                    (self.clock.time.now() - self.started).as_secs_f64(),
                    &stats,
                );
                nodes.push(serde_json::to_string(&own).map_err(|e| Error::Config(e.to_string()))?);
                net.send(self.succ, Message::Control(Control::Report { nodes }))?;
                Ok(true)
            }
            Message::Tensor(h, _) => Err(protocol(
                net,
                from,
                &format!("{:?} tensor for step {}", h.tag, h.step),
            )),
            Message::Control(_) => Err(protocol(net, from, "control message")),
        }
    }
}
