//! One DiLoCo worker. Every worker holds a replica and trains it alone on its share of each
//! global batch with the inner optimizer (the job's: SGD, Adam or AdamW, each worker its own
//! state); every H steps (per fragment, staggered when there are several) the workers average
//! their pseudo-gradients — the outer parameters minus their own — with the bucketed ring
//! all-reduce, and every worker applies the same outer step (Nesterov SGD) to the outer
//! parameters and restarts that fragment from them.
//!
//! A worker holds the replica, the inner optimizer's state and the outer state (parameters and
//! momentum: two model-sized buffers more than all-reduce SGD), and during a synchronisation
//! its pseudo-gradients of the fragments synchronised, kept until the round lands
//! (`super::round`).
//!
//! Faults: a worker that dies is noticed at the next synchronisation; rank 0 re-forms the ring
//! on the survivors (`allreduce::elastic`) and they redo that synchronisation without
//! it — the dead worker's inner steps since are lost, the survivors' are not. A worker whose
//! count of outer updates differs from rank 0's takes rank 0's outer state and contributes no
//! pseudo-gradient to that synchronisation (bucket 0 carries each worker's weight, 1 or 0, so
//! the average is over the workers that trained). Under `--inner-seconds` a worker that has
//! used its time before a synchronisation skips the remaining inner steps to it (their share of
//! examples unseen), so the synchronisation waits for no one longer than the window.
//!
//! Invariants: the outer parameters and momentum are the same bits on every worker (they are
//! changed only by the reduced, hence identical, averages); each fragment synchronises every H
//! steps and all of them at the last step, so the run ends on the outer model on every worker.

use std::time::Instant;

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::DroppedNode;
use ringtmp_model::Stage;
use ringtmp_transport::Transport;
use serde_json::json;

use super::DilocoJob;
use super::round::{Layout, Round};
use crate::collective::elastic::Regrouping;
use crate::collective::outer::{OuterState, SyncSchedule, fragments};
use crate::collective::reduce::{MAX_BUCKETS, Ring};
use crate::data_parallel::write_model;
use crate::data_parallel::{WorkerOutcome, report};
use crate::error::{Error, Result};

/// Cuts `range` into buckets of at most `bytes` (of f32), last first (the order all-reduce
/// SGD's backward produces them in; any fixed order works here).
fn bucket_ranges(range: std::ops::Range<usize>, bytes: usize) -> Vec<std::ops::Range<usize>> {
    let per = (bytes / 4).max(1);
    let mut out = Vec::new();
    let mut end = range.end;
    while end > range.start {
        let start = end.saturating_sub(per).max(range.start);
        out.push(start..end);
        end = start;
    }
    out
}

/// Swaps the outer parameters into `stage` for `f` (an evaluation, a checkpoint of the outer
/// model) and back.
fn with_outer<T>(
    stage: &mut Stage,
    outer: &mut OuterState,
    f: impl FnOnce(&mut Stage) -> Result<T>,
) -> Result<T> {
    if ringtmp_meter::phantom() {
        return f(stage);
    }
    stage.params_mut().swap_with_slice(&mut outer.global);
    let out = f(stage);
    stage.params_mut().swap_with_slice(&mut outer.global);
    out
}

/// Runs worker `rank` of `job` on `data`; rank 0 evaluates the outer model, checkpoints it and
/// writes the run's outputs.
#[expect(
    clippy::too_many_lines,
    reason = "a worker's lifecycle written by hand; the one data-parallel loop is to provide it"
)]
pub fn run_worker(
    job: &DilocoJob,
    rank: u32,
    data: &Dataset,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&crate::Event),
) -> Result<WorkerOutcome> {
    let spec = &job.spec;
    let n = job.workers;
    let (_, mut stage, mut optimizer) = spec.open_replica()?;
    let mut outer = if ringtmp_meter::phantom() {
        OuterState::default()
    } else {
        OuterState::new(stage.params())
    };
    let tensors: Vec<std::ops::Range<usize>> = stage
        .param_ranges()
        .map(|(_, r)| r)
        .filter(|r| !r.is_empty())
        .collect();
    let parts = fragments(&tensors, job.fragments);
    if parts.len() < job.fragments && rank == 0 {
        // A fragment is whole tensors: a model of few tensors cannot be cut finer.
        tracing::warn!(
            "diloco: --outer-fragments {} asked for, but this model's {} parameter tensors make \
             only {} fragments of about equal size; synchronising {} fragments",
            job.fragments,
            tensors.len(),
            parts.len(),
            parts.len()
        );
    }
    let buckets: Vec<Vec<std::ops::Range<usize>>> = parts
        .iter()
        .map(|p| bucket_ranges(p.clone(), job.bucket_bytes))
        .collect();
    let layout = Layout { parts, buckets };
    if layout.buckets.iter().map(Vec::len).sum::<usize>() >= MAX_BUCKETS {
        return Err(Error::Config(format!(
            "the outer all-reduce would need more than {MAX_BUCKETS} buckets"
        )));
    }
    let schedule = SyncSchedule {
        h: job.inner_steps,
        f: layout.parts.len(),
        total: spec.total_steps,
    };
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
        json!({"workers": n, "inner_steps": job.inner_steps, "fragments": layout.parts.len(), "overlap": job.overlap,
               "outer": job.outer, "outer_dtype": job.outer_dtype,
               "params": stage.params().len()}),
        on_event,
    )?;
    let started = clock.now();
    let (mut train_seconds, mut compute_seconds, mut sync_wait) = (0.0f64, 0.0f64, 0.0f64);
    let (mut samples, mut iterations, mut skipped) = (0u64, 0u64, 0u64);
    // The examples of this worker's own shares, skipped steps not counted.
    let mut trained = 0u64;
    let mut ring = Ring {
        members: (0..n as u32).collect(),
        generation: 0,
    };
    let mut dropped: Vec<DroppedNode> = Vec::new();
    // Inner steps taken since each fragment's last synchronisation.
    let mut since_sync = vec![0u64; layout.parts.len()];
    // The synchronisation in flight, overlapping inner steps.
    let mut pending: Option<Round> = None;
    let mut step = spec.first_step();
    // Seconds of inner steps since the last synchronisation (any fragment).
    let mut window_spent = 0.0f64;
    while step < spec.total_steps {
        let t_step = clock.now();
        // Only under --inner-seconds: finding the interval scans the schedule.
        let window = job.inner_seconds.map(|s| {
            let next_sync = schedule.next_after(step);
            s * (next_sync - schedule.previous_before(next_sync)) as f64 / job.inner_steps as f64
        });
        let mut step_loss = f64::NAN;
        if window.is_some_and(|w| window_spent >= w) {
            // Out of time before the synchronisation: this step's share is skipped.
            skipped += 1;
        } else {
            let (t0, wall) = (clock.now(), Instant::now());
            let (at, m) = (ring.position(rank).expect("a member"), ring.members.len());
            step_loss = crate::data_parallel::forward_share(
                spec, &mut plan, data, &mut stage, at as u32, m, step, &mut share,
            )?;
            let lr = spec.lr_at(step);
            match spec.clip_grad_norm {
                // The norm needs the whole gradient before any update.
                Some(max_norm) => {
                    stage.backward(0, &share.dlogits)?;
                    crate::clipping::clip_whole(&mut stage, max_norm);
                    stage.step(&mut optimizer, lr);
                }
                None => {
                    // Between layers, the synchronisation in flight moves along.
                    let mut failure = None;
                    let mut between = || {
                        if let Some(round) = pending.as_mut()
                            && failure.is_none()
                            && let Err(e) = round.pump(net)
                        {
                            failure = Some(e);
                        }
                    };
                    stage.backward_and_step(0, &share.dlogits, &mut optimizer, lr, &mut between)?;
                    if let Some(e) = failure {
                        return Err(e);
                    }
                }
            }
            clock.computed(wall.elapsed(), speed);
            let spent = (clock.now() - t0).as_secs_f64();
            compute_seconds += spent;
            window_spent += spent;
            since_sync.iter_mut().for_each(|t| *t += 1);
            iterations += 1;
            trained += (share.y.len() / spec.positions()) as u64;
            if !step_loss.is_finite() {
                return Err(Error::Diverged {
                    step,
                    loss: step_loss,
                });
            }
        }
        // Rank 0's progress lines count the global batch of every step; the summary counts
        // the examples the workers trained (their reports: skipped shares are not).
        samples += global as u64;
        step += 1;
        let mut ctx = SyncContext {
            job,
            rank,
            layout: &layout,
            schedule: &schedule,
            ring: &mut ring,
            stage: &mut stage,
            outer: &mut outer,
            trained: &mut since_sync,
            dropped: &mut dropped,
        };
        let waited = clock.now();
        if let Some(round) = pending.take_if(|r| r.lands_at <= step) {
            step = ctx.land(round, job.mix, step, net, recorder.as_mut(), on_event)?;
        }
        let due = schedule.due(step);
        if !due.is_empty() {
            let trained_since = due.iter().all(|p| ctx.trained[*p] > 0);
            let rate = spec.rate_before(step, job.inner_steps);
            let mut round = Round::take(
                &layout,
                step,
                due,
                ctx.stage,
                ctx.outer,
                trained_since,
                rate,
            );
            for p in &round.due {
                ctx.trained[*p] = 0;
            }
            window_spent = 0.0;
            round.launch(job, rank, ctx.ring, &layout, net)?;
            if job.overlap > 0 && step + job.overlap < spec.total_steps {
                round.lands_at = step + job.overlap;
                pending = Some(round);
            } else {
                step = ctx.land(round, 0.0, step, net, recorder.as_mut(), on_event)?;
            }
        }
        sync_wait += (clock.now() - waited).as_secs_f64();
        train_seconds += (clock.now() - t_step).as_secs_f64();
        net.step_done();
        let done = step;
        let Some(recorder) = recorder.as_mut() else {
            continue;
        };
        let lr = spec.lr_at(done - 1);
        if step_loss.is_finite() {
            recorder.announce_step(done, step_loss, lr, (train_seconds, samples), on_event)?;
        }
        let mut verdict = crate::recorder::Verdict::default();
        if spec.eval_due(done) {
            let score = with_outer(&mut stage, &mut outer, |stage| {
                crate::evaluation::evaluate(stage, &data.test, data.classes)
            })?;
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
            let dir = with_outer(&mut stage, &mut outer, |stage| {
                write_model(spec, job.workers, super::NAME, stage, &optimizer, done, &[])
            })?;
            recorder.announce_checkpoint(done, dir, on_event)?;
        }
    }
    if skipped > 0 {
        on_event(&crate::Event::Notice {
            text: format!(
                "diloco: rank {rank} skipped {skipped} inner steps to meet --inner-seconds"
            ),
        });
    }
    let mut own = crate::data_parallel::worker_summary(
        rank,
        &stage,
        &optimizer,
        net,
        &crate::data_parallel::WorkerClock {
            train_seconds,
            compute_seconds,
            wait_seconds: sync_wait,
            iterations,
            samples: trained,
        },
    );
    // The outer parameters and momentum are optimizer state too.
    own.optimizer_bytes += 2 * own.params * 4;
    let totals = crate::data_parallel::RunTotals {
        params: stage.params().len() as u64,
        steps: spec.total_steps,
        samples,
        samples_from_reports: true,
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

/// What landing a round may change: the ring (re-formed around the dead), the replica and
/// outer state (rank 0's taken where they differ), the counts of steps trained.
struct SyncContext<'a> {
    job: &'a DilocoJob,
    rank: u32,
    layout: &'a Layout,
    schedule: &'a SyncSchedule,
    ring: &'a mut Ring,
    stage: &'a mut Stage,
    outer: &'a mut OuterState,
    trained: &'a mut [u64],
    dropped: &'a mut Vec<DroppedNode>,
}

impl SyncContext<'_> {
    /// Lands `round` after `step` steps, keeping `mix` of the fragments' own parameters; a
    /// broken reduction re-forms the ring and lands it there, sent again (or, when this worker
    /// took rank 0's outer state, the round rank 0 is redoing, with nothing of this worker's).
    /// Returns the step count to go on from (rank 0's).
    fn land(
        &mut self,
        mut round: Round,
        mix: f32,
        step: u64,
        net: &mut dyn Transport,
        mut recorder: Option<&mut crate::recorder::RunRecorder>,
        on_event: &mut dyn FnMut(&crate::Event),
    ) -> Result<u64> {
        let mut step = step;
        let mut mix = mix;
        loop {
            let broke = match round.land(self.job, self.ring, self.stage, self.outer, mix, net)? {
                Ok(landed) => {
                    if let Some(recorder) = recorder.as_mut() {
                        recorder.write(json!({"event": "outer_step", "step": round.done,
                            "fragments": round.due, "contributors": landed.contributors}))?;
                    }
                    return Ok(step);
                }
                Err(broke) => broke,
            };
            let regrouping = Regrouping {
                rank: self.rank,
                step,
                timeout: self.job.spec.recv_timeout(),
            };
            step = regrouping.after(
                broke,
                net,
                self.ring,
                self.outer,
                self.dropped,
                recorder.as_deref_mut(),
                on_event,
            )?;
            if std::mem::take(&mut self.outer.replaced) {
                // Rank 0's outer state replaced this worker's: its own progress is void. It
                // restarts from the outer model and joins the round rank 0 redoes (the one
                // after the updates it took) with nothing of its own.
                if !ringtmp_meter::phantom() {
                    self.stage.params_mut().copy_from_slice(&self.outer.global);
                }
                self.trained.iter_mut().for_each(|t| *t = 0);
                let first = self.job.spec.first_step();
                let done = self
                    .schedule
                    .nth(first, self.outer.updates)
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "diloco: rank 0's outer state has {} updates, past the run's last \
                             synchronisation",
                            self.outer.updates
                        ))
                    })?;
                round = Round::take(
                    self.layout,
                    done,
                    self.schedule.due(done),
                    self.stage,
                    self.outer,
                    false,
                    self.job.spec.rate_before(done, self.job.inner_steps),
                );
                round.void();
                mix = 0.0;
            }
            round.launch(self.job, self.rank, self.ring, self.layout, net)?;
        }
    }
}
