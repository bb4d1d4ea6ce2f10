//! Stage replicas (`--stage-replicas K`), what a node keeps so that the ring can heal around a
//! dead one (after Bamboo, NSDI 2023, which keeps such replicas for preemptible pipelines).
//!
//! Every K mini-batches, at a point where the pipeline is empty, the master starts a replication
//! round: it sends `Replicate` to every node at once; each node snapshots its own stage and
//! optimizer state in memory ([`Snapshot`]) and sends that snapshot to its predecessor, followed
//! by a `Replicate` token over the same link, so when a node has its successor's token, it has
//! its successor's replica (links are FIFO) — and says so to the master with a `Replicate` of its
//! own. The round is complete when the master has node 1's replica and every node's word: all
//! links carry their snapshot at once, so a round takes the largest stage's transfer, not the sum
//! of them. Every node keeps its last two snapshots and replicas ([`Replicas`]): a round that a
//! failure interrupts may be half done, the one before it is whole. How the ring uses them when
//! a node dies is [`crate::heal`]'s.

use std::collections::VecDeque;
use std::time::Duration;

use ringtmp_model::{Layer, Optimizer, OptimizerConfig, Stage};

use crate::run::driver::RingJob;
use ringtmp_contract::error::{Error, Result};

/// The `micro_batch` of a `Params` tensor that carries a replica.
pub const REPLICA: u64 = u64::MAX - 1;

/// A node's stage and optimizer state at a step, in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// Mini-batches completed when it was taken.
    pub step: u64,
    /// The stage's layers.
    pub layers: std::ops::Range<usize>,
    /// Its parameters, in layer order.
    pub params: Vec<f32>,
    /// The optimizer's state tensors (as [`Optimizer::state`] names them).
    pub state: Vec<(String, Vec<f32>)>,
    /// The optimizer's step count.
    pub optimizer_steps: u64,
    /// Rings of rings under `--replica-sync diloco:H`: the outer momentum of these layers (a
    /// round follows each outer step, so their outer parameters are `params`); empty elsewhere.
    pub outer_velocity: Vec<f32>,
}

impl Snapshot {
    /// Takes one of `stage` (holding `layers`) and `optimizer` after mini-batch `step`.
    pub fn take(
        step: u64,
        layers: std::ops::Range<usize>,
        stage: &Stage,
        optimizer: &Optimizer,
    ) -> Self {
        Self {
            step,
            layers,
            params: stage.params().to_vec(),
            state: optimizer
                .state()
                .into_iter()
                .map(|(name, values)| (name.to_string(), values.to_vec()))
                .collect(),
            optimizer_steps: optimizer.steps(),
            outer_velocity: Vec::new(),
        }
    }

    /// With the outer momentum of its layers (see [`Snapshot::outer_velocity`]).
    pub fn with_outer_velocity(mut self, velocity: Vec<f32>) -> Self {
        self.outer_velocity = velocity;
        self
    }

    /// As one vector for the wire: the parameters, then each state tensor, then the outer
    /// momentum if there is one.
    pub fn to_values(&self) -> Vec<f32> {
        let mut values = self.params.clone();
        for (_, s) in &self.state {
            values.extend_from_slice(s);
        }
        values.extend_from_slice(&self.outer_velocity);
        values
    }

    /// Back from [`Snapshot::to_values`], for a stage of `layers` of `model` under `optimizer`;
    /// `None` when the length does not match (a peer's protocol error).
    pub fn from_values(
        step: u64,
        layers: std::ops::Range<usize>,
        model: &[Layer],
        optimizer: &OptimizerConfig,
        optimizer_steps: u64,
        values: &[f32],
    ) -> Option<Self> {
        let params: usize = model[layers.clone()].iter().map(Layer::param_count).sum();
        let names: Vec<&str> = Optimizer::new(optimizer.clone(), 0)
            .state()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let expected = params * (1 + names.len());
        // A phantom run (the simulator's sizes-only mode) sends the snapshot's size only; its
        // values are meaningless there, so zeros of the right length stand in for them.
        let zeros;
        let values = if values.is_empty() && expected > 0 && ringtmp_meter::phantom() {
            zeros = vec![0.0f32; expected];
            &zeros[..]
        } else {
            values
        };
        // An outer momentum follows, as long as the parameters, or nothing does.
        let (values, outer_velocity) = if params > 0 && values.len() == expected + params {
            let (own, outer) = values.split_at(expected);
            (own, outer.to_vec())
        } else {
            (values, Vec::new())
        };
        if values.len() != expected {
            return None;
        }
        let mut chunks = values.chunks(params.max(1));
        let params_values = if params == 0 {
            Vec::new()
        } else {
            chunks.next()?.to_vec()
        };
        let state = names
            .iter()
            .map(|n| {
                let v = if params == 0 {
                    Vec::new()
                } else {
                    chunks.next().unwrap_or_default().to_vec()
                };
                (n.to_string(), v)
            })
            .collect();
        Some(Self {
            step,
            layers,
            params: params_values,
            state,
            optimizer_steps,
            outer_velocity,
        })
    }

    /// This snapshot followed by `next` (the successor's block): one stage's state.
    pub fn joined(&self, next: &Snapshot) -> Self {
        Self {
            step: self.step,
            layers: self.layers.start..next.layers.end,
            params: [self.params.as_slice(), next.params.as_slice()].concat(),
            state: self
                .state
                .iter()
                .zip(&next.state)
                .map(|((name, a), (_, b))| (name.clone(), [a.as_slice(), b.as_slice()].concat()))
                .collect(),
            optimizer_steps: self.optimizer_steps,
            outer_velocity: [
                self.outer_velocity.as_slice(),
                next.outer_velocity.as_slice(),
            ]
            .concat(),
        }
    }

    /// Puts the state into `stage` and `optimizer` (built for the same layers).
    pub fn restore(&self, stage: &mut Stage, optimizer: &mut Optimizer) -> Result<()> {
        if stage.params().len() != self.params.len() {
            return Err(Error::Config(format!(
                "a replica of {} parameters for a stage of {}",
                self.params.len(),
                stage.params().len()
            )));
        }
        stage.params_mut().copy_from_slice(&self.params);
        let tensors: Vec<(&str, Vec<f32>)> = self
            .state
            .iter()
            .map(|(n, v)| (n.as_str(), v.clone()))
            .collect();
        optimizer.load_state(&tensors, self.optimizer_steps)?;
        Ok(())
    }
}

/// What a node keeps for healing: its own last two snapshots and its successor's last two
/// replicas, by step; on the master also the last complete round.
#[derive(Debug, Default)]
pub struct Replicas {
    own: VecDeque<Snapshot>,
    succ: VecDeque<Snapshot>,
    /// Master: the step of the last round whose token came back.
    pub completed: Option<u64>,
    /// Master: when it came back (on the run's clock).
    pub completed_at: Option<Duration>,
    /// Bytes sent in replication rounds (reported beside the training traffic).
    pub bytes_sent: u64,
    /// Master: the last mini-batch it completed (where a failure found the run).
    pub last_step: u64,
}

impl Replicas {
    /// Keeps this node's own snapshot (the older of two goes).
    pub fn keep_own(&mut self, snapshot: Snapshot) {
        keep(&mut self.own, snapshot);
    }

    /// Keeps the successor's replica.
    pub fn keep_succ(&mut self, snapshot: Snapshot) {
        keep(&mut self.succ, snapshot);
    }

    /// This node's own snapshot of `step`.
    pub fn own_at(&self, step: u64) -> Option<&Snapshot> {
        self.own.iter().find(|s| s.step == step)
    }

    /// The successor's replica of `step`.
    pub fn succ_at(&self, step: u64) -> Option<&Snapshot> {
        self.succ.iter().find(|s| s.step == step)
    }

    /// Bytes held (for the report).
    pub fn bytes(&self) -> u64 {
        self.own
            .iter()
            .chain(&self.succ)
            .map(|s| {
                (s.params.len()
                    + s.state.iter().map(|(_, v)| v.len()).sum::<usize>()
                    + s.outer_velocity.len()) as u64
                    * 4
            })
            .sum()
    }
}

fn keep(slot: &mut VecDeque<Snapshot>, snapshot: Snapshot) {
    slot.retain(|s| s.step != snapshot.step);
    slot.push_back(snapshot);
    while slot.len() > 2 {
        slot.pop_front();
    }
}

/// Bytes of parameters and optimizer state of `layers` under `optimizer`.
fn state_bytes(layers: &[Layer], optimizer: &OptimizerConfig) -> u64 {
    let params: u64 = layers.iter().map(|l| l.param_count() as u64).sum();
    let tensors = 1 + Optimizer::new(optimizer.clone(), 0).state().len() as u64;
    params * tensors * 4
}

/// Refuses `--stage-replicas` where a node's memory limit cannot also hold its two snapshots and
/// its successor's two replicas (`available` is what each node's limit leaves its stage), and
/// with the head on the master (its layers would have no replica).
pub fn check_replicas_fit(
    job: &RingJob,
    layers: &[Layer],
    available: &[Option<u64>],
) -> Result<()> {
    if job.head.is_some() {
        return Err(Error::Config(
            "--stage-replicas and --master-holds-head do not go together yet: the head's layers \
             would have no replica"
                .into(),
        ));
    }
    if !layers.iter().any(|l| l.param_count() > 0) {
        return Ok(());
    }
    let n = job.partition.len();
    for (rank, plan) in job.partition.iter().enumerate() {
        let Some(Some(limit)) = available.get(rank) else {
            continue;
        };
        let own = state_bytes(&layers[plan.start..plan.end], &job.spec.optimizer);
        let succ = if rank + 1 < n {
            let next = &job.partition[rank + 1];
            state_bytes(&layers[next.start..next.end], &job.spec.optimizer)
        } else {
            0
        };
        let needs = plan.predicted_bytes + 2 * (own + succ);
        if needs > *limit {
            return Err(Error::Config(format!(
                "--stage-replicas does not fit node {rank}: its stage needs {}, its two \
                 snapshots {} and its successor's two replicas {}, beyond the {} its memory \
                 limit leaves (the process's own needs deducted)",
                ringtmp_contract::contract::show_bytes(plan.predicted_bytes),
                ringtmp_contract::contract::show_bytes(2 * own),
                ringtmp_contract::contract::show_bytes(2 * succ),
                ringtmp_contract::contract::show_bytes(*limit)
            )));
        }
    }
    Ok(())
}
