//! One worker of ring all-reduce SGD: every worker holds a replica, computes the gradient of its
//! share of each global batch, and the workers average their gradients with the ring all-reduce
//! of [`crate::collective::ring`] before every worker applies the same step.
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

use std::time::Instant;

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::DroppedNode;
use ringtmp_model::{Optimizer, Stage};
use ringtmp_transport::Transport;
use serde_json::json;

use super::AllReduceJob;
use crate::collective::elastic::{ModelReplica, Regrouping};
use crate::collective::reduce::{MAX_BUCKETS, Reduced, Reducer, Ring, buckets};
use crate::data_parallel::write_model;
use crate::data_parallel::{WorkerOutcome, report};
use crate::error::{Error, Result};

/// Runs worker `rank` of `job` on `data` until the job's last iteration; rank 0 evaluates,
/// checkpoints and writes the run's outputs. A worker that dies is left behind: the survivors
/// re-form the ring and go on from rank 0's replica (rank 0's death ends the run).
#[expect(
    clippy::too_many_lines,
    reason = "a worker's lifecycle written by hand; the one data-parallel loop is to provide it"
)]
pub fn run_worker(
    job: &AllReduceJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&crate::Event),
) -> Result<WorkerOutcome> {
    let spec = &job.spec;
    let n = job.workers;
    let (_, mut stage, mut optimizer) = spec.open_replica()?;
    let ranges = buckets(&stage, job.bucket_bytes);
    if ranges.len() >= MAX_BUCKETS {
        return Err(Error::Config(format!(
            "--bucket-mb too small: {} buckets (at most {MAX_BUCKETS})",
            ranges.len()
        )));
    }
    let clock = net.clock();
    let speed = job.node_speeds.get(rank as usize).copied().unwrap_or(1.0);
    let global = spec.batch_size * n;
    let mut plan = BatchPlan::new(data.train.len(), global, spec.seed)?;
    let mut share = crate::data_parallel::ShareBuffers::default();
    let mut recorder = crate::data_parallel::open_recorder(
        spec,
        super::NAME,
        rank,
        stage.params().len(),
        json!({"workers": n, "buckets": ranges.len(), "bucket_bytes": job.bucket_bytes,
                    "params": stage.params().len()}),
        on_event,
    )?;
    let started = clock.now();
    let (mut train_seconds, mut compute_seconds, mut reduce_wait) = (0.0f64, 0.0f64, 0.0f64);
    let (mut samples, mut iterations) = (0u64, 0u64);
    let mut ring = Ring {
        members: (0..n as u32).collect(),
        generation: 0,
    };
    let mut dropped: Vec<DroppedNode> = Vec::new();
    let mut step = spec.first_step();
    while step < spec.total_steps {
        let t_step = clock.now();
        let (t0, wall) = (clock.now(), Instant::now());
        let (at, m) = (ring.position(rank).expect("a member"), ring.members.len());
        let mut local_loss = crate::data_parallel::forward_share(
            spec, &mut plan, data, &mut stage, at as u32, m, step, &mut share,
        )? as f32;
        // Shares differ by a row when the survivors do not divide the global batch: weigh each
        // share's mean by its rows, so the sum over workers divided by m is the batch's mean.
        // (A language model's share has a label per position: its rows are windows.)
        let rows = share.y.len() / spec.positions();
        let weight = (rows * m) as f32 / global as f32;
        if weight != 1.0 {
            share.dlogits.iter_mut().for_each(|d| *d *= weight);
            local_loss *= weight;
        }
        let mut reducer = Reducer::new(
            rank,
            &ring,
            &ranges,
            1,
            step,
            spec.recv_timeout(),
            spec.wire_dtype,
        );
        backward_overlapping(
            job.overlap,
            &mut stage,
            &share.dlogits,
            &mut reducer,
            local_loss,
            net,
        )?;
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t0).as_secs_f64();
        // Whatever the backward did not start yet (the first layers' bucket), then the rest of
        // the reduction.
        let waited = clock.now();
        reducer.start_ready(0, stage.grads(), local_loss, net)?;
        reducer.finish(net)?;
        reduce_wait += (clock.now() - waited).as_secs_f64();
        iterations += 1;
        let reduced = match reducer.close(net) {
            Ok(reduced) => reduced,
            Err(broke) => {
                // The step is abandoned; the survivors go on from rank 0's replica.
                stage.zero_grad();
                let regrouped = Regrouping {
                    rank,
                    step,
                    timeout: spec.recv_timeout(),
                };
                step = regrouped.after(
                    broke,
                    net,
                    &mut ring,
                    &mut ModelReplica {
                        stage: &mut stage,
                        optimizer: &mut optimizer,
                    },
                    &mut dropped,
                    recorder.as_mut(),
                    on_event,
                )?;
                train_seconds += (clock.now() - t_step).as_secs_f64();
                continue;
            }
        };
        // The mean of the workers' gradients, then the same step on every replica.
        let step_loss = take_mean(&mut stage, &reduced, m);
        let lr = spec.lr_at(step);
        let (t1, wall) = (clock.now(), Instant::now());
        if let Some(max_norm) = spec.clip_grad_norm {
            // Every replica holds the same averaged gradient: the same norm and factor, the
            // large batch's own clipping.
            crate::clipping::clip_whole(&mut stage, max_norm);
        }
        stage.step(&mut optimizer, lr);
        clock.computed(wall.elapsed(), speed);
        compute_seconds += (clock.now() - t1).as_secs_f64();
        train_seconds += (clock.now() - t_step).as_secs_f64();
        samples += global as u64;
        if !step_loss.is_finite() {
            return Err(Error::Diverged {
                step,
                loss: step_loss,
            });
        }
        step += 1;
        let done = step;
        net.step_done();
        let Some(recorder) = recorder.as_mut() else {
            continue;
        };
        recorder.announce_step(done, step_loss, lr, (train_seconds, samples), on_event)?;
        let mut verdict = crate::recorder::Verdict::default();
        if spec.eval_due(done) {
            let score = crate::evaluation::evaluate(&mut stage, &data.test, data.classes)?;
            verdict = recorder.announce_eval(
                done,
                score,
                train_seconds,
                (clock.now() - started).as_secs_f64(),
                on_event,
            )?;
        }
        // The best evaluation's checkpoint: rank 0 holds the model (the outer one, for DiLoCo).
        if spec.checkpoint_due(done) || verdict.checkpoint {
            let dir = write_checkpoint(job, &stage, &optimizer, done)?;
            recorder.announce_checkpoint(done, dir, on_event)?;
        }
    }
    // Every worker's measurements, straight to rank 0.
    let own = crate::data_parallel::worker_summary(
        rank,
        &stage,
        &optimizer,
        net,
        &crate::data_parallel::WorkerClock {
            train_seconds,
            compute_seconds,
            wait_seconds: reduce_wait,
            iterations,
            samples: 0,
        },
    );
    let totals = crate::data_parallel::RunTotals {
        params: stage.params().len() as u64,
        steps: spec.total_steps,
        samples,
        samples_from_reports: false,
        wall_seconds: 0.0,
        train_seconds,
    };
    let summary = report(
        (spec, super::NAME, job.workers),
        net,
        rank,
        &ring,
        own,
        recorder,
        (totals, started),
        dropped,
        on_event,
    )?;
    Ok(WorkerOutcome { stage, summary })
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

/// Rank 0 writes the one model every replica holds, in the format every strategy reads.
fn write_checkpoint(
    job: &AllReduceJob,
    stage: &Stage,
    optimizer: &Optimizer,
    step: u64,
) -> Result<std::path::PathBuf> {
    write_model(
        &job.spec,
        job.workers,
        super::NAME,
        stage,
        optimizer,
        step,
        &[],
    )
}
