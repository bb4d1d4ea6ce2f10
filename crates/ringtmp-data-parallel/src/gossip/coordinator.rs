//! Rank 0's bookkeeping in AD-PSGD, without I/O: the workers run at their own pace and report
//! each iteration; from those reports rank 0 counts global steps (N worker iterations make one,
//! the same samples as one step of the synchronous strategies), records their loss, decides when
//! the workers' models are gathered to evaluate or checkpoint their average, and when the run has
//! done its work.
//!
//! The run's length is a budget of worker iterations (N per global step), handed out as grants
//! by guided self-scheduling (Polychronopoulos and Kuck, 1987): each worker may run up to the
//! iterations granted to it, and is topped up with a share of what is left that shrinks as the
//! budget runs out, so a fast worker is never held back early and the run ends on its budget. Without
//! grants a worker ran on until rank 0's order to stop reached it: on a 100 Mbit/s emulated
//! cluster that order (and the progress reports it follows) queue behind 12 MB models, and the
//! passive workers trained 6.8× the run's samples before it arrived.
//!
//! Invariants: a global step is recorded once, in order, and only when the workers together have
//! done its iterations; the iterations granted never exceed the budget, so the iterations done
//! never do either (a worker does not run beyond its grant); rounds of gathering never overlap
//! (one in flight; those that fall due meanwhile wait their turn); a worker that left is no longer
//! awaited, its iterations stay counted (its samples were trained on) and what it was granted but
//! did not report goes back to the others.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use ringtmp_metrics::DroppedNode;

use ringtmp_contract::spec::RunSpec;

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
    /// Iterations each worker may complete in this run.
    granted: Vec<u64>,
    /// Iterations of the budget not granted to anyone yet.
    unassigned: u64,
}

impl Coordinator {
    /// The iterations every worker may run before its first grant arrives (every worker computes
    /// it from the job): a quarter of its even share, so the first grants go to whoever is fast.
    pub fn initial_grant(workers: u32, first_step: u64, total_steps: u64) -> u64 {
        let budget = total_steps.saturating_sub(first_step) * u64::from(workers);
        budget / (4 * u64::from(workers.max(1)))
    }

    /// A run of `workers` workers going from `first_step` to `total_steps` global steps.
    pub fn new(workers: u32, first_step: u64, total_steps: u64) -> Self {
        let budget = total_steps.saturating_sub(first_step) * u64::from(workers);
        let initial = Self::initial_grant(workers, first_step, total_steps);
        Self {
            granted: vec![initial; workers as usize],
            unassigned: budget - initial * u64::from(workers),
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

    /// New grants, `(rank, iterations it may complete in all)`: every live worker whose grant is
    /// within one share of running out gets one more share of what is left — half of it spread
    /// over the live workers, so shares shrink towards the end — before it stops to wait.
    pub fn grants(&mut self) -> Vec<(u32, u64)> {
        let mut grants = Vec::new();
        let live = self.live.len().max(1) as u64;
        for &rank in &self.live {
            if self.unassigned == 0 {
                break;
            }
            let share = self.unassigned.div_ceil(2 * live);
            let r = rank as usize;
            let outstanding = self.granted[r].saturating_sub(self.progress[r]);
            if outstanding <= share {
                self.granted[r] += share;
                self.unassigned -= share;
                grants.push((rank, self.granted[r]));
            }
        }
        grants
    }

    /// Iterations granted to worker `rank` so far.
    pub fn granted(&self, rank: u32) -> u64 {
        self.granted.get(rank as usize).copied().unwrap_or(0)
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
        // What it was granted but did not report doing goes back to the others.
        let r = rank as usize;
        self.unassigned += self.granted[r].saturating_sub(self.progress[r]);
        self.granted[r] = self.progress[r];
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

    /// Drives a coordinator with workers of the given speeds (iterations per tick, reports
    /// arriving `lag` ticks late), granting as rank 0 does; returns each worker's iterations.
    fn simulate(speeds: &[u64], lag: usize, total_steps: u64, die: Option<(u32, u64)>) -> Vec<u64> {
        let n = speeds.len() as u32;
        let mut c = Coordinator::new(n, 0, total_steps);
        let initial = Coordinator::initial_grant(n, 0, total_steps);
        let mut allowed = vec![initial; speeds.len()];
        let mut done = vec![0u64; speeds.len()];
        let mut reports: VecDeque<Vec<(u32, u64)>> = VecDeque::new();
        for tick in 0..100_000u64 {
            for (r, speed) in speeds.iter().enumerate() {
                if die.is_some_and(|(d, at)| d as usize == r && tick >= at) {
                    continue;
                }
                done[r] = (done[r] + speed).min(allowed[r]);
            }
            reports.push_back(
                done.iter()
                    .enumerate()
                    .map(|(r, d)| (r as u32, *d))
                    .collect(),
            );
            if reports.len() > lag {
                for (r, d) in reports.pop_front().unwrap() {
                    c.progress(r, d, 1.0);
                }
            }
            if let Some((d, at)) = die
                && tick == at + 3
            {
                c.drop_worker(d, "gone".into());
            }
            for (r, up_to) in c.grants() {
                assert!(up_to >= allowed[r as usize], "grants only grow");
                allowed[r as usize] = up_to;
            }
            let granted: u64 = (0..n).map(|r| c.granted(r)).sum();
            assert!(
                granted <= total_steps * u64::from(n),
                "never more than the budget"
            );
            if c.actions(|_| false).contains(&Action::Stop) {
                return done;
            }
        }
        panic!("the run never stopped: done {done:?}, allowed {allowed:?}");
    }

    #[test]
    fn grants_end_the_run_on_its_budget_and_fast_workers_do_more() {
        for lag in [0, 1, 5, 40] {
            let done = simulate(&[1, 4, 1, 4], lag, 250, None);
            assert_eq!(done.iter().sum::<u64>(), 1000, "lag {lag}: {done:?}");
            // Reports as late as 40% of the run cost the fast workers waits, never the budget.
            let more = if lag <= 5 { 2 } else { 1 };
            assert!(
                done[1] > more * done[0],
                "lag {lag}: the fast do more: {done:?}"
            );
        }
        // A worker that dies leaves its ungranted share to the others, and the rest is done.
        let done = simulate(&[2, 2, 2, 2], 2, 100, Some((3, 10)));
        let dead = done[3];
        assert!(dead < 100, "{done:?}");
        assert_eq!(done.iter().sum::<u64>(), 400, "{done:?}");
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
