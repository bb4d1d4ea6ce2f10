//! One worker of ring all-reduce SGD: every worker holds a replica, computes the gradient of its
//! share of each global batch, and the workers average their gradients with the ring all-reduce
//! of [`ringtmp_collective::ring`] before every worker applies the same step.
//!
//! Gradients go out in buckets as backward produces them, last layer first (PyTorch DDP's
//! buckets): the between-layers hook of [`Stage::backward_streaming`] starts each bucket whose
//! layers are done and moves every bucket in progress as far as what has arrived allows, so the
//! reduction overlaps the rest of the backward pass. Messages of a bucket that this worker has
//! not started yet wait in that bucket until it has.
//!
//! A dead worker breaks the reduction in progress; rank 0 re-forms the ring on the survivors
//! (`Control::Regroup` and its state), and everyone goes on from rank 0's step with the same
//! global batch (docs/decisions/strategy-shape.md, "Elastic all-reduce").
//!
//! Invariants: every chunk is summed in the plan's fixed order, so a run is reproducible and the
//! replicas stay bit-identical (also after a re-formation, which starts from one replica); chunks
//! carry the ring's generation, so none from an abandoned attempt is ever summed; the step's mean
//! loss travels in bucket 0's last slot; every wait has the job's timeout and names the peer.

use std::ops::Range;

use ringtmp_data::Dataset;
use ringtmp_metrics::DroppedNode;
use ringtmp_model::Stage;
use ringtmp_transport::Transport;
use serde_json::json;

use super::AllReduceJob;
use crate::replicas::WorkerOutcome;
use crate::worker_loop::{self, Ending, Log, Opening, Stepped, SyncRule, Worker};
use ringtmp_collective::elastic::{ModelReplica, Regrouping};
use ringtmp_collective::reduce::{MAX_BUCKETS, Reduced, Reducer, Ring, buckets};
use ringtmp_contract::error::{Error, Result};

/// Runs worker `rank` of `job` on `data` until the job's last iteration; rank 0 evaluates,
/// checkpoints and writes the run's outputs. A worker that dies is left behind: the survivors
/// re-form the ring and go on from rank 0's replica (rank 0's death ends the run).
pub fn run_worker(
    job: &AllReduceJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<WorkerOutcome> {
    let opening = Opening::of(
        &job.spec,
        super::NAME,
        rank,
        job.workers,
        &job.node_speeds,
        data,
    );
    worker_loop::run(
        &opening,
        |worker| EveryStep::new(job, &worker.stage),
        net,
        on_event,
    )
}

/// All-reduce's synchronisation: the mean of the workers' gradients, every step, on the ring
/// of the live workers.
struct EveryStep<'j> {
    job: &'j AllReduceJob,
    /// The gradient's buckets, last layer first.
    ranges: Vec<Range<usize>>,
    ring: Ring,
    dropped: Vec<DroppedNode>,
}

impl<'j> EveryStep<'j> {
    fn new(job: &'j AllReduceJob, stage: &Stage) -> Result<Self> {
        let ranges = buckets(stage, job.bucket_bytes);
        if ranges.len() >= MAX_BUCKETS {
            return Err(Error::Config(format!(
                "--bucket-mb too small: {} buckets (at most {MAX_BUCKETS})",
                ranges.len()
            )));
        }
        Ok(Self {
            job,
            ranges,
            ring: Ring::of(job.workers),
            dropped: Vec::new(),
        })
    }
}

impl SyncRule for EveryStep<'_> {
    fn start_fields(&self, worker: &Worker<'_>) -> serde_json::Value {
        json!({"workers": self.job.workers, "buckets": self.ranges.len(),
               "bucket_bytes": self.job.bucket_bytes, "params": worker.stage.params().len()})
    }

    fn step(
        &mut self,
        worker: &mut Worker<'_>,
        step: u64,
        net: &mut dyn Transport,
        log: &mut Log<'_>,
    ) -> Result<Stepped> {
        let spec = worker.spec;
        let rank = worker.rank;
        let global = spec.batch_size * self.job.workers;
        let span = worker.start_compute();
        let (at, m) = (
            self.ring.position(rank).expect("a member"),
            self.ring.members.len(),
        );
        let mut local_loss = worker.forward(at as u32, m, step)? as f32;
        // Shares differ by a row when the survivors do not divide the global batch: weigh each
        // share's mean by its rows, so the sum over workers divided by m is the batch's mean.
        // (A language model's share has a label per position: its rows are windows.)
        let rows = worker.share.y.len() / spec.positions();
        let weight = (rows * m) as f32 / global as f32;
        if weight != 1.0 {
            worker.share.dlogits.iter_mut().for_each(|d| *d *= weight);
            local_loss *= weight;
        }
        let mut reducer = Reducer::new(
            rank,
            &self.ring,
            &self.ranges,
            1,
            step,
            spec.recv_timeout(),
            spec.wire_dtype,
        );
        backward_overlapping(
            self.job.overlap,
            &mut worker.stage,
            &worker.share.dlogits,
            &mut reducer,
            local_loss,
            net,
        )?;
        worker.computed(span);
        // Whatever the backward did not start yet (the first layers' bucket), then the rest of
        // the reduction.
        let waited = worker.clock.now();
        reducer.start_ready(0, worker.stage.grads(), local_loss, net)?;
        reducer.finish(net)?;
        worker.waited_since(waited);
        worker.iterations += 1;
        let reduced = match reducer.close(net) {
            Ok(reduced) => reduced,
            Err(broke) => {
                // The step is abandoned; the survivors go on from rank 0's replica.
                worker.stage.zero_grad();
                let regrouping = Regrouping {
                    rank,
                    step,
                    timeout: spec.recv_timeout(),
                };
                let from = regrouping.after(
                    broke,
                    net,
                    &mut self.ring,
                    &mut ModelReplica {
                        stage: &mut worker.stage,
                        optimizer: &mut worker.optimizer,
                    },
                    &mut self.dropped,
                    log.recorder.as_deref_mut(),
                    log.on_event,
                )?;
                return Ok(Stepped::Redo { from });
            }
        };
        // The mean of the workers' gradients, then the same step on every replica.
        let step_loss = take_mean(&mut worker.stage, &reduced, m);
        let lr = spec.lr_at(step);
        let span = worker.start_compute();
        if let Some(max_norm) = spec.clip_grad_norm {
            // Every replica holds the same averaged gradient: the same norm and factor, the
            // large batch's own clipping.
            ringtmp_contract::clipping::clip_whole(&mut worker.stage, max_norm);
        }
        worker.stage.step(&mut worker.optimizer, lr);
        worker.computed(span);
        Ok(Stepped::Trained {
            loss: Some(step_loss),
            lr,
            next: step + 1,
        })
    }

    fn finish(
        &mut self,
        _: &mut Worker<'_>,
        _: &mut dyn FnMut(&ringtmp_contract::Event),
    ) -> Result<Ending> {
        Ok(Ending {
            members: self.ring.members.clone(),
            dropped: std::mem::take(&mut self.dropped),
            ..Ending::default()
        })
    }
}

/// The backward pass of this worker's share, overlapped (when `overlap`) with the reduction:
/// between layers it starts the buckets whose gradients are complete and moves the ones in
/// flight. A failure is kept until the layer ends (a hook cannot return one).
fn backward_overlapping(
    overlap: bool,
    stage: &mut Stage,
    dlogits: &[f32],
    reducer: &mut Reducer,
    local_loss: f32,
    net: &mut dyn Transport,
) -> Result<()> {
    let mut failure: Option<Error> = None;
    let mut hook = |offset: usize, tail: &[f32]| {
        if failure.is_some() || !overlap {
            return;
        }
        let moved = reducer
            .start_ready(offset, tail, local_loss, net)
            .and_then(|()| reducer.pump(net));
        if let Err(e) = moved {
            failure = Some(e);
        }
    };
    stage.backward_streaming(0, dlogits, &mut hook)?;
    failure.map_or(Ok(()), Err)
}

/// Replaces `stage`'s gradient by the mean of the `m` workers' (the reduced sums, bucket by
/// bucket); returns the mean of their losses (carried after the first bucket's values).
fn take_mean(stage: &mut Stage, reduced: &[Reduced], m: usize) -> f64 {
    if ringtmp_meter::phantom() {
        return 0.0;
    }
    let scale = 1.0 / m as f32;
    let mut step_loss = 0.0f64;
    let grads = stage.grads_mut();
    for (b, (range, sums)) in reduced.iter().enumerate() {
        let len = range.len();
        grads[range.clone()]
            .iter_mut()
            .zip(&sums[..len])
            .for_each(|(g, v)| *g = v * scale);
        if b == 0 {
            step_loss = f64::from(sums[len]) / m as f64;
        }
    }
    step_loss
}
