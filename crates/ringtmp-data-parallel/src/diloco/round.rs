//! One synchronisation of a DiLoCo worker ("a round"): its pseudo-gradients taken at a step
//! count, their all-reduce in flight (started at once, landed then or τ inner steps later), the
//! outer step on their mean, and the fragments' restart from the outer parameters.
//!
//! Invariants: the pseudo-gradients are kept until the round lands, so a round broken by a
//! death is sent again, unchanged, on the re-formed ring; every worker applies the same reduced
//! bits, so the outer state stays identical; a worker that contributes nothing (it did not train
//! since, or took rank 0's state) sends zeros with weight 0, and the mean is over the weights.

use std::ops::Range;

use ringtmp_model::Stage;
use ringtmp_transport::Transport;

use super::DilocoJob;
use super::cadence::Launch;
use ringtmp_collective::outer::OuterState;
use ringtmp_collective::reduce::{Break, Reduced, Reducer, Ring};
use ringtmp_contract::error::Result;

/// The model's fragments and each one's buckets (fixed for the run).
pub(crate) struct Layout {
    /// The fragments' parameter ranges, in order.
    pub(crate) parts: Vec<Range<usize>>,
    /// Each fragment's buckets.
    pub(crate) buckets: Vec<Vec<Range<usize>>>,
}

impl Layout {
    /// The contiguous span of fragments `due` (one fragment, or all of them).
    fn span(&self, due: &[usize]) -> Range<usize> {
        let start = due.iter().map(|p| self.parts[*p].start).min().unwrap_or(0);
        let end = due.iter().map(|p| self.parts[*p].end).max().unwrap_or(0);
        start..end
    }
}

/// A round's outcome.
pub(crate) struct Landed {
    /// Workers whose pseudo-gradients were averaged (the sum of the weights).
    pub(crate) contributors: f32,
}

/// One synchronisation of fragments `due` after `done` steps.
pub(crate) struct Round {
    /// The step count it was taken at (the reduction's id).
    pub(crate) done: u64,
    /// The fragments.
    pub(crate) due: Vec<usize>,
    /// The step count at which it is applied (`done`, or `done + τ` overlapped).
    pub(crate) lands_at: u64,
    span: Range<usize>,
    /// The inner steps' mean learning rate since the fragments' last synchronisation, as a
    /// fraction of the peak (the outer step's `rate`).
    rate: f32,
    /// This worker's pseudo-gradients over `span` (zeros when its weight is 0).
    delta: Vec<f32>,
    weight: f32,
    reducer: Option<Reducer>,
}

impl Round {
    /// Takes this worker's pseudo-gradients (outer − own) of `launch`'s fragments, or zeros
    /// when it does not contribute; `rate` is the outer step's.
    pub(crate) fn take(
        layout: &Layout,
        launch: Launch,
        stage: &Stage,
        outer: &OuterState,
        rate: f32,
    ) -> Self {
        let Launch {
            done,
            due,
            contributes,
            lands_at,
        } = launch;
        let span = layout.span(&due);
        let delta = if ringtmp_meter::phantom() {
            Vec::new()
        } else if contributes {
            outer.global[span.clone()]
                .iter()
                .zip(&stage.params()[span.clone()])
                .map(|(global, local)| global - local)
                .collect()
        } else {
            vec![0.0; span.len()]
        };
        Self {
            done,
            due,
            lands_at: lands_at.unwrap_or(done),
            span,
            rate,
            delta,
            weight: if contributes { 1.0 } else { 0.0 },
            reducer: None,
        }
    }

    /// Starts the all-reduce on `ring`: the first chunks leave now.
    pub(crate) fn launch(
        &mut self,
        job: &DilocoJob,
        rank: u32,
        ring: &Ring,
        layout: &Layout,
        net: &mut dyn Transport,
    ) -> Result<()> {
        let ranges: Vec<Range<usize>> = self
            .due
            .iter()
            .flat_map(|p| layout.buckets[*p].iter().cloned())
            .collect();
        let mut reducer = Reducer::new(
            rank,
            ring,
            &ranges,
            1,
            self.done,
            job.spec.recv_timeout(),
            job.outer_dtype.wire(),
        );
        reducer.start_ready(self.span.start, &self.delta, self.weight, net)?;
        self.reducer = Some(reducer);
        Ok(())
    }

    /// Moves the reduction along with whatever has arrived, without waiting.
    pub(crate) fn pump(&mut self, net: &mut dyn Transport) -> Result<()> {
        match self.reducer.as_mut() {
            // A complete reduction reads nothing more: what arrives now is the next round's.
            Some(reducer) if !reducer.done() => reducer.pump(net),
            _ => Ok(()),
        }
    }

    /// Waits for the reduction and applies it: one outer step of the mean pseudo-gradient,
    /// then the fragments restart from the outer parameters — `mix` of their own kept (0 after
    /// a blocking round; Streaming DiLoCo's mixing after an overlapped one, whose fragments
    /// moved on meanwhile). `Err` is why the reduction broke; the round can be launched again.
    pub(crate) fn land(
        &mut self,
        job: &DilocoJob,
        ring: &Ring,
        stage: &mut Stage,
        outer: &mut OuterState,
        mix: f32,
        net: &mut dyn Transport,
    ) -> Result<std::result::Result<Landed, Break>> {
        let Some(mut reducer) = self.reducer.take() else {
            unreachable!("a round lands after its launch")
        };
        reducer.finish(net)?;
        let reduced: Vec<Reduced> = match reducer.close(net) {
            Ok(reduced) => reduced,
            Err(broke) => return Ok(Err(broke)),
        };
        let phantom = ringtmp_meter::phantom();
        let contributors = if phantom {
            ring.members.len() as f32
        } else {
            reduced[0].1[reduced[0].0.len()]
        };
        if !phantom && contributors > 0.0 {
            let scale = 1.0 / contributors;
            let mut mean = Vec::new();
            for (range, sums) in &reduced {
                mean.clear();
                mean.extend(sums[..range.len()].iter().map(|s| s * scale));
                outer.step(&job.outer, range.clone(), &mean, self.rate);
            }
        }
        outer.updates += 1;
        if !phantom {
            let params = stage.params_mut();
            let (own, global) = (
                &mut params[self.span.clone()],
                &outer.global[self.span.clone()],
            );
            if mix == 0.0 {
                own.copy_from_slice(global);
            } else {
                own.iter_mut()
                    .zip(global)
                    .for_each(|(o, g)| *o = mix * *o + (1.0 - mix) * g);
            }
        }
        Ok(Ok(Landed { contributors }))
    }
}
