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

use ringtmp_data::Dataset;
use ringtmp_metrics::DroppedNode;
use ringtmp_model::{Optimizer, Stage};
use ringtmp_transport::Transport;
use serde_json::json;

use super::DilocoJob;
use super::cadence::Cadence;
use super::round::{Layout, Round};
use crate::replicas::WorkerOutcome;
use crate::worker_loop::{self, Ending, Log, Opening, RecordedModel, Stepped, SyncRule, Worker};
use ringtmp_collective::elastic::Regrouping;
use ringtmp_collective::outer::{OuterState, SyncSchedule, fragments};
use ringtmp_collective::reduce::{MAX_BUCKETS, Ring};
use ringtmp_contract::error::{Error, Result};

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
pub fn run_worker(
    job: &DilocoJob,
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
    worker_loop::run(&opening, |worker| EveryH::new(job, worker), net, on_event)
}

/// DiLoCo's synchronisation: inner steps alone, and every H steps per fragment the outer step
/// on the workers' mean pseudo-gradient (in flight over the next `overlap` inner steps).
struct EveryH<'j> {
    job: &'j DilocoJob,
    layout: Layout,
    /// When rounds launch and land, and what each fragment trained since its last one.
    cadence: Cadence,
    /// The outer parameters and momentum (the same bits on every worker).
    outer: OuterState,
    ring: Ring,
    dropped: Vec<DroppedNode>,
    /// The synchronisation in flight, overlapping inner steps.
    pending: Option<Round>,
    /// Seconds of inner steps since the last synchronisation (any fragment).
    window_spent: f64,
    /// Inner steps skipped to meet `--inner-seconds`.
    skipped: u64,
}

impl<'j> EveryH<'j> {
    fn new(job: &'j DilocoJob, worker: &Worker<'_>) -> Result<Self> {
        let stage = &worker.stage;
        let outer = if ringtmp_meter::phantom() {
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
        if parts.len() < job.fragments && worker.rank == 0 {
            // A fragment is whole tensors: a model of few tensors cannot be cut finer.
            tracing::warn!(
                "diloco: --outer-fragments {} asked for, but this model's {} parameter tensors \
                 make only {} fragments of about equal size; synchronising {} fragments",
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
            total: job.spec.total_steps,
        };
        Ok(Self {
            job,
            cadence: Cadence::new(schedule, job.overlap, job.spec.first_step()),
            layout,
            outer,
            ring: Ring::of(job.workers),
            dropped: Vec::new(),
            pending: None,
            window_spent: 0.0,
            skipped: 0,
        })
    }

    /// One inner step on this worker's share (the synchronisation in flight moving along
    /// between layers); returns its loss.
    fn inner_step(
        &mut self,
        worker: &mut Worker<'_>,
        step: u64,
        net: &mut dyn Transport,
    ) -> Result<f64> {
        let spec = worker.spec;
        let span = worker.start_compute();
        let (at, m) = (
            self.ring.position(worker.rank).expect("a member"),
            self.ring.members.len(),
        );
        let loss = worker.forward(at as u32, m, step)?;
        let lr = spec.lr_at(step);
        let Worker {
            stage,
            optimizer,
            share,
            ..
        } = worker;
        match spec.clip_grad_norm {
            // The norm needs the whole gradient before any update.
            Some(max_norm) => {
                stage.backward(0, &share.dlogits)?;
                ringtmp_contract::clipping::clip_whole(stage, max_norm);
                stage.step(optimizer, lr);
            }
            None => {
                // Between layers, the synchronisation in flight moves along.
                let mut failure = None;
                let pending = &mut self.pending;
                let mut between = || {
                    if let Some(round) = pending.as_mut()
                        && failure.is_none()
                        && let Err(e) = round.pump(net)
                    {
                        failure = Some(e);
                    }
                };
                stage.backward_and_step(0, &share.dlogits, optimizer, lr, &mut between)?;
                if let Some(e) = failure {
                    return Err(e);
                }
            }
        }
        self.window_spent += worker.computed(span);
        self.cadence.stepped();
        worker.iterations += 1;
        worker.own_samples += (worker.share.y.len() / spec.positions()) as u64;
        if !loss.is_finite() {
            return Err(Error::Diverged { step, loss });
        }
        Ok(loss)
    }

    /// After `step` steps: lands the round in flight when it is due, and launches the
    /// fragments' synchronisation that is due. Returns the step count to go on from (rank 0's,
    /// after a regroup).
    fn synchronise(
        &mut self,
        worker: &mut Worker<'_>,
        step: u64,
        net: &mut dyn Transport,
        log: &mut Log<'_>,
    ) -> Result<u64> {
        let (job, spec) = (self.job, worker.spec);
        let mut step = step;
        let mut ctx = SyncContext {
            job,
            rank: worker.rank,
            layout: &self.layout,
            cadence: &mut self.cadence,
            ring: &mut self.ring,
            stage: &mut worker.stage,
            outer: &mut self.outer,
            dropped: &mut self.dropped,
        };
        if let Some(round) = self
            .pending
            .take_if(|r| ctx.cadence.lands(r.lands_at, step))
        {
            step = ctx.land(
                round,
                job.mix,
                step,
                net,
                log.recorder.as_deref_mut(),
                log.on_event,
            )?;
        }
        let Some(launch) = ctx.cadence.launch(step) else {
            return Ok(step);
        };
        let lands_at = launch.lands_at;
        let mut round = Round::take(
            &self.layout,
            launch,
            ctx.stage,
            ctx.outer,
            spec.rate_before(step, job.inner_steps),
        );
        self.window_spent = 0.0;
        round.launch(job, worker.rank, ctx.ring, &self.layout, net)?;
        if lands_at.is_some() {
            self.pending = Some(round);
        } else {
            step = ctx.land(
                round,
                0.0,
                step,
                net,
                log.recorder.as_deref_mut(),
                log.on_event,
            )?;
        }
        Ok(step)
    }
}

impl SyncRule for EveryH<'_> {
    fn start_fields(&self, worker: &Worker<'_>) -> serde_json::Value {
        let job = self.job;
        json!({"workers": job.workers, "inner_steps": job.inner_steps,
               "fragments": self.layout.parts.len(), "overlap": job.overlap,
               "outer": job.outer, "outer_dtype": job.outer_dtype,
               "params": worker.stage.params().len()})
    }

    fn step(
        &mut self,
        worker: &mut Worker<'_>,
        step: u64,
        net: &mut dyn Transport,
        log: &mut Log<'_>,
    ) -> Result<Stepped> {
        // Only under --inner-seconds: finding the interval scans the schedule.
        let window = self.job.inner_seconds.map(|s| {
            let schedule = self.cadence.schedule();
            let next_sync = schedule.next_after(step);
            s * (next_sync - schedule.previous_before(next_sync)) as f64
                / self.job.inner_steps as f64
        });
        let loss = if window.is_some_and(|w| self.window_spent >= w) {
            // Out of time before the synchronisation: this step's share is skipped.
            self.skipped += 1;
            None
        } else {
            Some(self.inner_step(worker, step, net)?)
        };
        // The run's step lines count the global batch of every step; the summary counts the
        // examples the workers trained (their reports: skipped shares are not).
        let waited = worker.clock.now();
        let next = self.synchronise(worker, step + 1, net, log)?;
        worker.waited_since(waited);
        Ok(Stepped::Trained {
            loss,
            lr: worker.spec.lr_at(next - 1),
            next,
        })
    }

    fn with_model(
        &mut self,
        worker: &mut Worker<'_>,
        _: u64,
        _: &mut dyn Transport,
        record: &mut dyn FnMut(RecordedModel<'_>) -> Result<()>,
    ) -> Result<()> {
        if worker.rank != 0 {
            return Ok(());
        }
        // Rank 0 evaluates and checkpoints the outer model.
        let optimizer: &Optimizer = &worker.optimizer;
        with_outer(&mut worker.stage, &mut self.outer, |stage| {
            record(RecordedModel {
                stage,
                optimizer,
                replicas: &[],
                after_eval: None,
            })
        })
    }

    fn finish(
        &mut self,
        worker: &mut Worker<'_>,
        on_event: &mut dyn FnMut(&ringtmp_contract::Event),
    ) -> Result<Ending> {
        if self.skipped > 0 {
            on_event(&ringtmp_contract::Event::Notice {
                text: format!(
                    "diloco: rank {} skipped {} inner steps to meet --inner-seconds",
                    worker.rank, self.skipped
                ),
            });
        }
        Ok(Ending {
            members: self.ring.members.clone(),
            dropped: std::mem::take(&mut self.dropped),
            // The outer parameters and momentum are optimizer state too.
            extra_optimizer_bytes: 2 * worker.stage.params().len() as u64 * 4,
            samples_from_reports: true,
            ..Ending::default()
        })
    }
}

/// What landing a round may change: the ring (re-formed around the dead), the replica and
/// outer state (rank 0's taken where they differ), the counts of steps trained.
struct SyncContext<'a> {
    job: &'a DilocoJob,
    rank: u32,
    layout: &'a Layout,
    cadence: &'a mut Cadence,
    ring: &'a mut Ring,
    stage: &'a mut Stage,
    outer: &'a mut OuterState,
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
        mut recorder: Option<&mut ringtmp_contract::recorder::RunRecorder>,
        on_event: &mut dyn FnMut(&ringtmp_contract::Event),
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
                let redo = self.cadence.redo(self.outer.updates)?;
                let rate = self.job.spec.rate_before(redo.done, self.job.inner_steps);
                round = Round::take(self.layout, redo, self.stage, self.outer, rate);
                mix = 0.0;
            }
            round.launch(self.job, self.rank, self.ring, self.layout, net)?;
        }
    }
}
