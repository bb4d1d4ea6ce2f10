//! Rank 0's bookkeeping in AD-PSGD, without I/O: the workers run at their own pace and report
//! each iteration; from those reports rank 0 counts global steps (N worker iterations make one,
//! the same samples as one step of the synchronous strategies), records their loss, decides when
//! the workers' models are gathered to evaluate or checkpoint their average, and when the run has
//! done its work.
//!
//! Invariants: a global step is recorded once, in order, and only when the workers together have
//! done its iterations; rounds of gathering never overlap (one in flight; those that fall due
//! meanwhile wait their turn); a worker that left is no longer awaited, and its iterations stay
//! counted (its samples were trained on).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use ringtmp_metrics::DroppedNode;

use crate::spec::RunSpec;

/// What rank 0 must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Record global step `step` with this mean training loss.
    Record {
        /// Global steps completed.
        step: u64,
        /// Mean loss of the iterations reported since the last record.
        loss: f64,
    },
    /// Ask every worker in `ranks` for its model, for global step `round`.
    Snapshot {
        /// The global step the models are gathered for.
        round: u64,
        /// Whom to ask (every live worker but rank 0).
        ranks: Vec<u32>,
    },
    /// The workers have done the run's iterations: tell them to stop.
    Stop,
}

/// A gathering of the workers' models in progress.
#[derive(Debug)]
pub struct Round {
    /// The global step it was started for.
    pub step: u64,
    /// The models received so far, by rank.
    pub models: BTreeMap<u32, Vec<f32>>,
    /// Workers whose model is still to come.
    awaiting: BTreeSet<u32>,
}

/// Rank 0's view of the run.
#[derive(Debug)]
pub struct Coordinator {
    workers: u32,
    first_step: u64,
    total_steps: u64,
    progress: Vec<u64>,
    loss_sum: f64,
    loss_count: u64,
    recorded: u64,
    due: VecDeque<u64>,
    round: Option<Round>,
    stopped: bool,
    live: BTreeSet<u32>,
    dropped: Vec<DroppedNode>,
}

impl Coordinator {
    /// A run of `workers` workers going from `first_step` to `total_steps` global steps.
    pub fn new(workers: u32, first_step: u64, total_steps: u64) -> Self {
        Self {
            workers,
            first_step,
            total_steps,
            progress: vec![0; workers as usize],
            loss_sum: 0.0,
            loss_count: 0,
            recorded: first_step,
            due: VecDeque::new(),
            round: None,
            stopped: false,
            live: (0..workers).collect(),
            dropped: Vec::new(),
        }
    }

    /// Worker `rank` has completed `iterations` iterations in this run, the last with `loss`.
    pub fn progress(&mut self, rank: u32, iterations: u64, loss: f64) {
        if let Some(p) = self.progress.get_mut(rank as usize)
            && iterations > *p
        {
            *p = iterations;
            self.loss_sum += loss;
            self.loss_count += 1;
        }
    }

    /// Worker iterations done in this run, all workers together.
    pub fn iterations(&self) -> u64 {
        self.progress.iter().sum()
    }

    /// Global steps completed (of the run, counting the resumed ones).
    pub fn global_step(&self) -> u64 {
        (self.first_step + self.iterations() / u64::from(self.workers)).min(self.total_steps)
    }

    /// What follows from the progress so far: steps to record (each with whatever falls due
    /// at it: `due(step)` says whether the models must be gathered then), a round to start, the
    /// order to stop. The run's last step is not gathered here: the workers' final models are.
    pub fn actions(&mut self, due: impl Fn(u64) -> bool) -> Vec<Action> {
        let mut actions = Vec::new();
        let global = self.global_step();
        if global > self.recorded {
            let loss = self.loss_sum / self.loss_count.max(1) as f64;
            (self.loss_sum, self.loss_count) = (0.0, 0);
            while self.recorded < global {
                self.recorded += 1;
                actions.push(Action::Record {
                    step: self.recorded,
                    loss,
                });
                if self.recorded < self.total_steps && due(self.recorded) {
                    self.due.push_back(self.recorded);
                }
            }
        }
        if global >= self.total_steps && !self.stopped {
            self.stopped = true;
            // Rounds not yet started would gather models after the end: the final one counts.
            self.due.clear();
            actions.push(Action::Stop);
        }
        if self.round.is_none()
            && let Some(step) = self.due.pop_front()
        {
            let awaiting: BTreeSet<u32> = self.live.iter().copied().filter(|r| *r != 0).collect();
            actions.push(Action::Snapshot {
                round: step,
                ranks: awaiting.iter().copied().collect(),
            });
            self.round = Some(Round {
                step,
                models: BTreeMap::new(),
                awaiting,
            });
        }
        actions
    }

    /// Rank 0's own model for the round just started.
    pub fn own_snapshot(&mut self, model: &[f32]) {
        if let Some(round) = self.round.as_mut() {
            round.models.insert(0, model.to_vec());
        }
    }

    /// Worker `rank`'s model for round `step`; whether it was expected.
    pub fn snapshot(&mut self, rank: u32, step: u64, model: Vec<f32>) -> bool {
        let Some(round) = self.round.as_mut().filter(|r| r.step == step) else {
            return false;
        };
        if !round.awaiting.remove(&rank) {
            return false;
        }
        round.models.insert(rank, model);
        true
    }

    /// The round in progress, once every live worker's model is in.
    pub fn completed_round(&mut self) -> Option<Round> {
        if self.round.as_ref()?.awaiting.is_empty() {
            self.round.take()
        } else {
            None
        }
    }

    /// Whether the order to stop has been given.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Worker `rank` died: it is no longer awaited. Returns false if it had already left.
    pub fn drop_worker(&mut self, rank: u32, reason: String) -> bool {
        if !self.live.remove(&rank) {
            return false;
        }
        if let Some(round) = self.round.as_mut() {
            round.awaiting.remove(&rank);
        }
        self.dropped.push(DroppedNode {
            rank,
            step: self.global_step(),
            reason,
        });
        true
    }

    /// The workers still in the run.
    pub fn live(&self) -> &BTreeSet<u32> {
        &self.live
    }

    /// The workers that left, with the global step and the failure observed.
    pub fn dropped(&self) -> &[DroppedNode] {
        &self.dropped
    }
}

/// Whether the models are gathered after global step `step` of `spec`.
pub fn gathering_due(spec: &RunSpec, step: u64) -> bool {
    spec.eval_due(step) || spec.checkpoint_due(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Record { step, .. } => Some(*step),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn global_steps_are_recorded_once_in_order_as_iterations_add_up() {
        let mut c = Coordinator::new(4, 0, 3);
        for r in 0..3 {
            c.progress(r, 1, 1.0);
        }
        assert!(c.actions(|_| false).is_empty(), "3 of 4 iterations");
        c.progress(3, 1, 3.0);
        assert_eq!(
            c.actions(|_| false),
            [Action::Record { step: 1, loss: 1.5 }]
        );
        // A fast worker alone makes the next steps: its iterations count like anyone's.
        c.progress(0, 9, 2.0);
        let a = c.actions(|_| false);
        assert_eq!(records(&a), [2, 3]);
        assert_eq!(a.last(), Some(&Action::Stop));
        assert!(c.actions(|_| false).is_empty(), "stop is given once");
        // Stale reports change nothing.
        c.progress(0, 5, 9.0);
        assert_eq!(c.iterations(), 12);
    }

    #[test]
    fn one_round_at_a_time_and_dead_workers_are_not_awaited() {
        let mut c = Coordinator::new(4, 10, 100);
        for r in 0..4 {
            c.progress(r, 2, 0.5);
        }
        // Steps 11 and 12 are both due: one round starts, the other waits.
        let a = c.actions(|s| s == 11 || s == 12);
        assert_eq!(records(&a), [11, 12]);
        assert!(a.contains(&Action::Snapshot {
            round: 11,
            ranks: vec![1, 2, 3]
        }));
        c.own_snapshot(&[0.0]);
        assert!(c.snapshot(1, 11, vec![1.0]));
        assert!(!c.snapshot(1, 12, vec![1.0]), "not this round");
        assert!(c.drop_worker(2, "closed".into()));
        assert!(!c.drop_worker(2, "closed".into()));
        assert!(c.completed_round().is_none());
        assert!(c.snapshot(3, 11, vec![3.0]));
        let round = c.completed_round().expect("every live model is in");
        assert_eq!(round.models.keys().copied().collect::<Vec<_>>(), [0, 1, 3]);
        let a = c.actions(|_| false);
        assert_eq!(
            a,
            [Action::Snapshot {
                round: 12,
                ranks: vec![1, 3]
            }]
        );
        assert_eq!(c.dropped()[0].rank, 2);
        assert_eq!(c.dropped()[0].step, 12);
    }

    #[test]
    fn the_last_step_is_not_gathered_and_pending_rounds_are_dropped_at_the_end() {
        let mut c = Coordinator::new(2, 0, 2);
        c.progress(0, 1, 1.0);
        c.progress(1, 1, 1.0);
        let a = c.actions(|_| true);
        assert!(matches!(a.last(), Some(Action::Snapshot { round: 1, .. })));
        c.progress(0, 3, 1.0);
        let a = c.actions(|_| true);
        assert_eq!(records(&a), [2]);
        assert!(a.contains(&Action::Stop));
        assert!(!a.iter().any(|a| matches!(a, Action::Snapshot { .. })));
    }
}
