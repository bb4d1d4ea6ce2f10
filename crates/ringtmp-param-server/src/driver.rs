//! The parameter server's job, its messages and the worker's loop (the server's is in
//! [`super::server`]): `S` servers each own a contiguous shard of the flat parameter vector
//! with its optimizer state; `W` workers each hold a full replica and train on units of work: unit
//! `u` is share `u mod W` of global batch `u div W` (global batches of `W·b` examples, in the same
//! order as `local` with batch `W·b`).
//!
//! Per iteration, worker `w` sends `Pull { clock }` to every server; a server answers with its
//! shard when the consistency model allows (otherwise it parks the request), server 0 adding the
//! unit the worker computes next (`Admission` says who decides what). The worker computes the
//! gradient of its mean loss on that unit and pushes each server its slice, tagged with the unit.
//! Servers apply gradients averaged over the workers: under BSP once per iteration, when every
//! live worker has pushed (exactly large-batch SGD); under SSP, ASP and DSSP as each push
//! arrives, scaled by `1/W`.
//!
//! Clipping by the global norm (`--clip-grad-norm`): under BSP the servers clip the mean
//! gradient, exactly as `local` clips its large batch's — each server's share of the squared
//! norm goes to every other server (`GradNorm`), and a server applies its shard once it has them
//! all, holding its answers to pulls until then. Under SSP, ASP and DSSP there is no step whose
//! gradient all workers share: each worker clips the gradient it pushes (the update it makes).
//!
//! Ranks: servers are `0..S`, workers `S..S+W`.

use std::ops::Range;
use std::time::{Duration, Instant};

use ringtmp_data::{BatchPlan, Dataset, shard};
use ringtmp_model::{Pass, Stage};
use ringtmp_transport::Transport;
use ringtmp_wire::message::{tensor_bytes_into, tensor_values_into};
use ringtmp_wire::{Dtype, Message, TensorHeader, TensorTag};
use serde::{Deserialize, Serialize};

pub use super::admission::NO_MORE_WORK;
use super::consistency::Consistency;
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::messages::StrategyMessage;
use ringtmp_contract::spec::RunSpec;

/// The parameter server's own wire messages (as [`StrategyMessage`]s).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PsMessage {
    /// A worker to a server: it has finished; the server stops waiting for it.
    Finished {
        /// Iterations it completed.
        iterations: u64,
    },
    /// Server 0 to every other server, with each answer under SSP and DSSP: `worker` computes
    /// `unit`, and every unit below `settled` had been pushed to server 0.
    Grant {
        /// The worker (its index among the workers).
        worker: u32,
        /// The unit it was given.
        unit: u64,
        /// The mark below which every unit had been pushed to server 0.
        settled: u64,
    },
    /// A worker to a server: send your shard for its iteration `clock` (its pushes so far).
    Pull {
        /// Pushes the worker has made.
        clock: u64,
    },
    /// A server to every other server under BSP with clipping: the squared L2 norm of its shard
    /// of iteration `iteration`'s mean gradient (the global norm is their sum).
    GradNorm {
        /// The global iteration.
        iteration: u64,
        /// The squared norm, as `f64::to_bits`.
        squared_bits: u64,
    },
}

impl StrategyMessage for PsMessage {
    const STRATEGY: &'static str = "ps";

    fn kind(&self) -> &'static str {
        match self {
            Self::Finished { .. } => "Finished",
            Self::Grant { .. } => "Grant",
            Self::Pull { .. } => "Pull",
            Self::GradNorm { .. } => "GradNorm",
        }
    }
}

/// Everything every node of a parameter-server run must agree on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PsJob {
    /// What every strategy's job shares; its `batch_size` is one worker's share of each global
    /// batch, and its steps count global iterations.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Servers (ranks `0..servers`).
    pub servers: usize,
    /// Workers (ranks `servers..servers + workers`).
    pub workers: usize,
    /// Consistency model.
    pub consistency: Consistency,
    /// Emulated relative speed per rank (1 = full speed; workers only).
    #[serde(default)]
    pub node_speeds: Vec<f64>,
    /// Keep training without a worker that died, even under BSP.
    pub drop_dead_workers: bool,
}

impl PsJob {
    pub(crate) fn layers(&self) -> Result<Vec<ringtmp_model::Layer>> {
        self.spec.layers()
    }

    pub(super) fn timeout(&self) -> Duration {
        self.spec.recv_timeout()
    }

    pub(super) fn checkpoint_due(&self, done: u64) -> bool {
        self.spec.checkpoint_due(done)
    }

    pub(super) fn checkpoint_dir(&self, step: u64) -> std::path::PathBuf {
        self.spec.checkpoint_dir(step)
    }

    /// Examples per worker per iteration.
    pub fn worker_batch(&self) -> usize {
        self.spec.batch_size
    }

    /// Iterations already done when resuming.
    pub fn first_step(&self) -> u64 {
        self.spec.first_step()
    }

    /// The learning rate of the global iteration unit `unit` belongs to.
    pub(super) fn lr_at_unit(&self, unit: u64) -> f32 {
        self.spec.lr_at(unit / self.workers as u64)
    }
}

/// Contiguous, near-equal shard `s` of `total` parameters over `servers` servers.
pub fn shard_range(total: usize, servers: usize, s: usize) -> Range<usize> {
    let (base, extra) = (total / servers, total % servers);
    let start = s * base + s.min(extra);
    start..start + base + usize::from(s < extra)
}

/// What a server measured, and its final shard.
#[derive(Clone, Debug)]
pub struct ServerOutcome {
    /// The shard's final parameters.
    pub params: Vec<f32>,
    /// Pulls that had to wait for the consistency model.
    pub parked_pulls: u64,
    /// Observed staleness histogram (index = iterations ahead of the slowest worker).
    pub staleness: Vec<u64>,
    /// Workers dropped after dying, with the iteration and the failure observed.
    pub dropped: Vec<ringtmp_metrics::DroppedNode>,
    /// Per worker, its observed staleness histogram at this server.
    pub worker_staleness: Vec<Vec<u64>>,
    /// Update staleness of the pushes applied one at a time (not under BSP).
    pub update_staleness: UpdateStaleness,
    /// End-of-run reports (JSON) that workers sent while this server was still serving others.
    pub reports: Vec<String>,
}

/// How stale the gradients a server applies are, counted in its own updates: a push computed from
/// the parameters sent when the server had applied `a` pushes, applied when it has applied `b`,
/// has staleness `b - a`. Under ASP, SSP and DSSP each push is one update; under BSP an update is
/// a whole iteration and nothing is recorded. The histogram is bounded: the last bucket holds
/// everything at or above it.
#[derive(Clone, Debug, Default)]
pub struct UpdateStaleness {
    /// Pushes applied so far.
    applied: u64,
    /// Per worker, `applied` when it was last sent this shard.
    sent_at: Vec<u64>,
    /// Index = staleness, value = pushes.
    pub histogram: Vec<u64>,
}

impl UpdateStaleness {
    /// Buckets kept; the last one counts every larger staleness too.
    const BUCKETS: usize = 64;

    pub(super) fn new(workers: usize) -> Self {
        Self {
            applied: 0,
            sent_at: vec![0; workers],
            histogram: Vec::new(),
        }
    }

    pub(super) fn sent(&mut self, w: usize) {
        self.sent_at[w] = self.applied;
    }

    /// Worker `w`'s push is being applied; returns its staleness.
    pub(super) fn applying(&mut self, w: usize) -> u64 {
        let tau = self.applied - self.sent_at[w];
        let bucket = (tau as usize).min(Self::BUCKETS - 1);
        if self.histogram.len() <= bucket {
            self.histogram.resize(bucket + 1, 0);
        }
        self.histogram[bucket] += 1;
        self.applied += 1;
        tau
    }

    /// Mean staleness of the pushes applied so far (0 when none were).
    pub fn mean(&self) -> f64 {
        let n: u64 = self.histogram.iter().sum();
        let total: u64 = self
            .histogram
            .iter()
            .enumerate()
            .map(|(t, c)| t as u64 * c)
            .sum();
        total as f64 / n.max(1) as f64
    }
}

/// A tensor message of `values` in a buffer from the node's pool: a gradient push (`step` the
/// worker's iteration, `unit` the unit of work it computed) or a parameter shard (`step` the
/// worker's clock, `unit` its next unit).
pub(super) fn tensor(
    net: &dyn Transport,
    tag: TensorTag,
    step: u64,
    unit: u64,
    values: &[f32],
    dtype: Dtype,
) -> Message {
    let header = TensorHeader {
        run_id: 0,
        step,
        micro_batch: unit,
        tag,
        dtype,
        shape: vec![values.len() as u32],
    };
    let mut payload = net.buffers().take(values.len() * dtype.size() as usize);
    tensor_bytes_into(values, dtype, &mut payload);
    Message::Tensor(header, payload)
}

/// What a worker measured.
#[derive(Clone, Debug, Default)]
pub struct WorkerOutcome {
    /// Iterations completed.
    pub iterations: u64,
    /// Seconds spent waiting for parameters (at the servers' gates and on the links).
    pub wait_seconds: f64,
    /// Seconds of compute.
    pub compute_seconds: f64,
    /// Examples processed.
    pub samples: u64,
    /// Sum of the mean losses of the units of the run's final epoch this worker computed.
    pub final_epoch_loss_sum: f64,
    /// Units of the run's final epoch this worker computed.
    pub final_epoch_units: u64,
}

/// What a worker tells its caller as it goes.
pub enum WorkerEvent<'a> {
    /// A pull brought work: the replica, and the global iteration of the unit it brought
    /// (under BSP the iterations the parameters hold), e.g. to evaluate it.
    Pulled {
        /// Global iteration of the unit.
        iteration: u64,
        /// The replica as pulled.
        stage: &'a mut Stage,
    },
    /// The worker pushed its gradient for a unit of global iteration `iteration`.
    Pushed {
        /// Global iteration of the unit.
        iteration: u64,
        /// Mean training loss of the unit's examples.
        loss: f64,
        /// The learning rate the servers apply to it.
        lr: f32,
    },
}

/// Runs worker `w` (rank `servers + w`) for the job's iterations on its share of every global
/// batch (the units server 0 assigns); `speed` < 1 emulates a slower node. The returned replica
/// holds the parameters of the last pull (under BSP, the final ones). `on_event` sees every pull
/// that brought work and every push.
pub fn run_worker(
    job: &PsJob,
    w: usize,
    data: &Dataset,
    speed: f64,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(WorkerEvent<'_>) -> Result<()>,
) -> Result<(WorkerOutcome, Stage)> {
    let layers = job.layers()?;
    let mut stage = job.spec.initial_stage(
        &layers,
        0..layers.len(),
        job.spec.threads,
        job.spec.resume_from.is_some(),
    )?;
    let total = stage.params().len();
    let ranges: Vec<Range<usize>> = (0..job.servers)
        .map(|s| shard_range(total, job.servers, s))
        .collect();
    let mut plan = BatchPlan::new(
        data.train.len(),
        job.spec.batch_size * job.workers,
        job.spec.seed,
    )?;
    let (mut x, mut y, mut d) = (Vec::new(), Vec::new(), Vec::new());
    let mut out = WorkerOutcome::default();
    let clock = net.clock();
    // The epoch of the run's last iteration: its units' losses make the run's final train loss.
    let final_epoch = job.spec.total_steps.saturating_sub(1) / job.spec.steps_per_epoch.max(1);
    // Pulls every shard for iteration `t`; returns the unit of work server 0 assigned.
    let pull = |t: u64,
                stage: &mut Stage,
                out: &mut WorkerOutcome,
                net: &mut dyn Transport|
     -> Result<u64> {
        let mut unit = NO_MORE_WORK;
        let waited = net.clock().now();
        for s in 0..job.servers {
            net.send(s as u32, PsMessage::Pull { clock: t }.to_message())?;
        }
        for (s, range) in ranges.iter().enumerate() {
            match net.recv_from(s as u32, job.timeout())? {
                Message::Tensor(h, bytes) if h.tag == TensorTag::Params && h.step == t => {
                    if s == 0 {
                        unit = h.micro_batch;
                    }
                    let values = h.elements().unwrap_or(u64::MAX);
                    if values != range.len() as u64 {
                        return Err(Error::Config(format!(
                            "worker {w}: shard of {values} values from server {s}, expected {}",
                            range.len()
                        )));
                    }
                    tensor_values_into(&bytes, h.dtype, &mut stage.params_mut()[range.clone()]);
                    net.buffers().give(bytes);
                }
                _ => {
                    return Err(Error::Config(format!(
                        "worker {w}: unexpected message from server {s}"
                    )));
                }
            }
        }
        out.wait_seconds += (net.clock().now() - waited).as_secs_f64();
        Ok(unit)
    };
    // Pull, work on the assigned unit, push — until server 0 says there is no more work (the last
    // pull leaves the replica with the current parameters).
    for t in 0.. {
        let unit = pull(t, &mut stage, &mut out, net)?;
        if unit == NO_MORE_WORK {
            break;
        }
        let workers = job.workers as u64;
        let (global, share) = (unit / workers, (unit % workers) as usize);
        on_event(WorkerEvent::Pulled {
            iteration: global,
            stage: &mut stage,
        })?;
        let computed = Instant::now();
        let computed_at = clock.now();
        let epoch = global / job.spec.steps_per_epoch;
        let batch = plan
            .batch(epoch, (global % job.spec.steps_per_epoch) as usize)
            .to_vec();
        let mine = shard(&batch, share, job.workers)?;
        data.train.gather(mine, &mut x, &mut y);
        let pass = Pass {
            train: true,
            seed: job.spec.seed,
            step: global,
            row_offset: share * job.spec.batch_size,
        };
        let logits = stage.forward(0, &x, mine.len(), &pass)?;
        d.resize(logits.len(), 0.0);
        let unit_loss =
            job.spec
                .objective
                .score(logits, &y, job.spec.classes, 1.0 / y.len() as f32, &mut d)?;
        if epoch == final_epoch {
            out.final_epoch_loss_sum += unit_loss.loss_sum / y.len() as f64;
            out.final_epoch_units += 1;
        }
        stage.backward(0, &d)?;
        if let Some(max_norm) = job.spec.clip_grad_norm
            && job.consistency != Consistency::Bsp
        {
            // No step's gradient is shared under a stale model: each worker clips its own.
            ringtmp_contract::clipping::clip_whole(&mut stage, max_norm);
        }
        clock.computed(computed.elapsed(), speed);
        out.compute_seconds += (clock.now() - computed_at).as_secs_f64();
        for (s, range) in ranges.iter().enumerate() {
            net.send(
                s as u32,
                tensor(
                    net,
                    TensorTag::ParamGrads,
                    t,
                    unit,
                    &stage.grads()[range.clone()],
                    job.spec.wire_dtype,
                ),
            )?;
        }
        stage.zero_grad();
        out.iterations += 1;
        out.samples += mine.len() as u64;
        on_event(WorkerEvent::Pushed {
            iteration: global,
            loss: unit_loss.loss_sum / y.len() as f64,
            lr: job.lr_at_unit(unit),
        })?;
    }
    for s in 0..job.servers {
        net.send(
            s as u32,
            PsMessage::Finished {
                iterations: out.iterations,
            }
            .to_message(),
        )?;
    }
    Ok((out, stage))
}
