//! Pipeline schedules as a pure decision rule per stage, and a discrete simulation of the whole
//! ring that prints which stage does which forward (F) or backward (B) at each time unit.
//!
//! Each stage decides on its own, from what it has received and its counters — no central
//! scheduler:
//! - `gpipe` (Huang et al., 2019): all forwards of the mini-batch, then all backwards.
//! - `1f1b` (PipeDream-Flush, Narayanan et al., 2021): at most `stages − stage` micro-batches in
//!   flight on a stage; with room, forward what has arrived, otherwise backward. The last stage
//!   therefore alternates one forward, one backward; stage 0 runs ahead by `stages` micro-batches.
//!
//! - `async` (PipeDream, Narayanan et al., 2019): no flush, a step after every micro-batch, each
//!   forward's weights stashed for its backward; static 1F1B, so stage s holds `window − s`
//!   micro-batches and which weight version each forward and backward sees is fixed by the
//!   schedule, never by when tensors arrive ([`StagePolicy::Async`]).
//!
//! The first two flush at the end of a mini-batch and step once, so both compute exactly
//! synchronous SGD over the mini-batch (they differ only in the order gradients are accumulated,
//! i.e. in floating point rounding, and in how many activations a stage holds).

use serde::{Deserialize, Serialize};

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// All forwards, then all backwards (synchronous SGD).
    Gpipe,
    /// One-forward-one-backward with a flush (synchronous SGD, bounded activation memory).
    #[serde(rename = "1f1b")]
    #[cfg_attr(feature = "cli", value(name = "1f1b"))]
    OneFOneB,
    /// No flush; a step after every micro-batch with weight stashing (PipeDream, Narayanan et
    /// al., SOSP 2019); decided by [`StagePolicy::Async`], not by [`StageState`].
    Async,
}

impl Schedule {
    /// Parses `gpipe` or `1f1b`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "gpipe" => Some(Self::Gpipe),
            "1f1b" => Some(Self::OneFOneB),
            "async" => Some(Self::Async),
            _ => None,
        }
    }

    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpipe => "gpipe",
            Self::OneFOneB => "1f1b",
            Self::Async => "async",
        }
    }
}

/// What a stage does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Forward the next micro-batch whose input has arrived.
    Forward,
    /// Backward the next micro-batch whose output gradient has arrived.
    Backward,
}

/// One stage's progress through a mini-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageState {
    /// The schedule.
    pub schedule: Schedule,
    /// This stage's index.
    pub stage: usize,
    /// Number of stages.
    pub stages: usize,
    /// Micro-batches per mini-batch.
    pub micro_batches: usize,
    /// Forwards done this mini-batch.
    pub forwards: usize,
    /// Backwards done this mini-batch.
    pub backwards: usize,
}

impl StageState {
    /// A stage at the start of a mini-batch.
    pub fn new(schedule: Schedule, stage: usize, stages: usize, micro_batches: usize) -> Self {
        Self {
            schedule,
            stage,
            stages,
            micro_batches,
            forwards: 0,
            backwards: 0,
        }
    }

    /// Most micro-batches this stage may hold between forward and backward.
    pub fn in_flight_limit(&self) -> usize {
        match self.schedule {
            Schedule::Gpipe => self.micro_batches,
            // One more than the stages after this one: the loss is one more step of the
            // pipeline, on the master, a round trip away from the last stage, and without it
            // the last stage idled for that round trip after every forward.
            Schedule::OneFOneB => (self.stages - self.stage + 1).min(self.micro_batches),
            Schedule::Async => (self.stages - self.stage).min(self.micro_batches),
        }
    }

    /// The next action given whether a forward input and a backward gradient are waiting.
    pub fn next(&self, input_ready: bool, grad_ready: bool) -> Option<Action> {
        let in_flight = self.forwards - self.backwards;
        let may_forward = self.forwards < self.micro_batches && in_flight < self.in_flight_limit();
        let may_backward = grad_ready
            && in_flight > 0
            && match self.schedule {
                Schedule::Gpipe => self.forwards == self.micro_batches,
                Schedule::OneFOneB | Schedule::Async => true,
            };
        if may_forward && input_ready {
            Some(Action::Forward)
        } else if may_backward {
            Some(Action::Backward)
        } else {
            None
        }
    }

    /// Records an action.
    pub fn record(&mut self, action: Action) {
        match action {
            Action::Forward => self.forwards += 1,
            Action::Backward => self.backwards += 1,
        }
    }

    /// Whether the mini-batch is complete on this stage (time to step).
    pub fn done(&self) -> bool {
        self.backwards == self.micro_batches
    }
}

/// A non-master stage's decision rule under any schedule, as one state machine: which work is
/// next, which arriving tensors belong to the work in progress, and when to step. The flushed
/// schedules and `async` differ only in this policy; the driver that moves messages and runs the
/// compute is the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagePolicy {
    /// `gpipe` or `1f1b`: mini-batch `step`, one optimizer step per flush.
    Flushed {
        /// Progress through the mini-batch.
        state: StageState,
        /// The mini-batch in progress.
        step: u64,
    },
    /// `async`: PipeDream's static 1F1B (Narayanan et al., SOSP 2019) — `depth` forwards to fill
    /// the stage, then one backward (and its step: each micro-batch is its own weight version)
    /// and one forward in turn — so the weights every forward and backward sees are a function
    /// of the schedule, never of when tensors arrive. Micro-batch `k` of the run is micro-batch
    /// `k mod m` of mini-batch `k div m`.
    Async {
        /// Micro-batches per mini-batch.
        micro_batches: u64,
        /// Micro-batches this stage holds between their forward and their backward in the
        /// steady state: the master's window less the stage's distance from it.
        depth: u64,
        /// Micro-batches of the run this stage has forwarded.
        forwarded: u64,
        /// Micro-batches of the run this stage has backwarded.
        backwarded: u64,
        /// The first micro-batch the master starts only after the pipeline has drained (an
        /// evaluation, a checkpoint or the run's end comes first): the stage's last backwards
        /// before it cannot wait for forwards that will not come.
        drain_at: u64,
    },
}

/// Where a forward goes: its tensors' header (step, id), and the mini-batch and the micro-batch
/// within it that seed its dropout and place its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardAt {
    /// The header's step.
    pub header_step: u64,
    /// The micro-batch id (and stash key).
    pub id: u64,
    /// Mini-batch.
    pub step: u64,
    /// Micro-batch within it.
    pub micro: usize,
}

impl StagePolicy {
    /// The policy of stage `stage` of `stages` for `schedule`, starting at mini-batch `first`;
    /// `window` is the master's async window (micro-batches between its forward and its own
    /// backward).
    pub fn new(
        schedule: Schedule,
        (stage, stages): (usize, usize),
        micro_batches: usize,
        window: usize,
        first: u64,
    ) -> Self {
        match schedule {
            Schedule::Async => Self::Async {
                micro_batches: micro_batches as u64,
                depth: window.saturating_sub(stage).max(1) as u64,
                forwarded: first * micro_batches as u64,
                backwarded: first * micro_batches as u64,
                drain_at: 0,
            },
            _ => Self::Flushed {
                state: StageState::new(schedule, stage, stages, micro_batches),
                step: first,
            },
        }
    }

    /// The next work given whether an input and a gradient are waiting.
    pub fn next(&self, input_ready: bool, grad_ready: bool) -> Option<Action> {
        match self {
            Self::Flushed { state, .. } => state.next(input_ready, grad_ready),
            &Self::Async {
                depth,
                forwarded,
                backwarded,
                drain_at,
                ..
            } => {
                let full = forwarded >= (backwarded + depth).min(drain_at);
                if grad_ready && full {
                    Some(Action::Backward)
                } else if input_ready && forwarded - backwarded < depth {
                    Some(Action::Forward)
                } else {
                    None
                }
            }
        }
    }

    /// Async: where the pipeline next drains, asked of `drain_after` (micro-batch → the first
    /// micro-batch past the next drain) whenever the stage has reached the last one.
    pub fn follow_drains(&mut self, drain_after: impl FnOnce(u64) -> u64) {
        if let Self::Async {
            backwarded,
            drain_at,
            ..
        } = self
            && *backwarded >= *drain_at
        {
            *drain_at = drain_after(*backwarded);
        }
    }

    /// Whether a training tensor tagged with `step` belongs to the work of this stage now (the
    /// flushed schedules take only their mini-batch's; async takes any).
    pub fn accepts(&self, step: u64) -> bool {
        match self {
            Self::Flushed { step: now, .. } => step == *now,
            Self::Async { .. } => true,
        }
    }

    /// Where the forward of arrived micro-batch `id` goes.
    pub fn forward_at(&self, id: u64) -> ForwardAt {
        match *self {
            Self::Flushed { step, .. } => ForwardAt {
                header_step: step,
                id,
                step,
                micro: id as usize,
            },
            Self::Async { micro_batches, .. } => ForwardAt {
                header_step: id,
                id,
                step: id / micro_batches,
                micro: (id % micro_batches) as usize,
            },
        }
    }

    /// The header step of the gradient a backward of `id` sends back.
    pub fn backward_step(&self, id: u64) -> u64 {
        match *self {
            Self::Flushed { step, .. } => step,
            Self::Async { .. } => id,
        }
    }

    /// Records `action` (of micro-batch `id`); returns the mini-batch whose optimizer step is
    /// now due, if one is.
    pub fn record(&mut self, action: Action, id: u64) -> Option<u64> {
        match self {
            Self::Flushed { state, step } => {
                state.record(action);
                if !state.done() {
                    return None;
                }
                let done = *step;
                *step += 1;
                *state = StageState::new(
                    state.schedule,
                    state.stage,
                    state.stages,
                    state.micro_batches,
                );
                Some(done)
            }
            Self::Async {
                micro_batches,
                forwarded,
                backwarded,
                ..
            } => match action {
                Action::Forward => {
                    *forwarded += 1;
                    None
                }
                Action::Backward => {
                    *backwarded += 1;
                    Some(id / *micro_batches)
                }
            },
        }
    }
}

/// Simulates one mini-batch on `stages` stages with unit-time forwards and backwards and instant
/// communication; returns, per stage, a row of `F<i>`, `B<i>` or `.` per time unit, and checks
/// the in-flight bound on the way. The loss is computed at the end of the last stage's forward.
pub fn simulate(schedule: Schedule, stages: usize, micro_batches: usize) -> Vec<Vec<String>> {
    let mut state: Vec<StageState> = (0..stages)
        .map(|s| StageState::new(schedule, s, stages, micro_batches))
        .collect();
    // Arrived inputs and gradients per stage (micro-batch ids, FIFO).
    let mut inputs: Vec<Vec<usize>> = vec![Vec::new(); stages];
    let mut grads: Vec<Vec<usize>> = vec![Vec::new(); stages];
    inputs[0] = (0..micro_batches).collect();
    let mut rows: Vec<Vec<String>> = vec![Vec::new(); stages];
    let mut time = 0;
    while state.iter().any(|s| !s.done()) {
        assert!(
            time < 4 * (micro_batches + stages) * 2,
            "schedule deadlocked"
        );
        let mut deliveries: Vec<(bool, usize, usize)> = Vec::new(); // (is_grad, stage, mb)
        for s in 0..stages {
            let cell = match state[s].next(!inputs[s].is_empty(), !grads[s].is_empty()) {
                Some(Action::Forward) => {
                    let mb = inputs[s].remove(0);
                    state[s].record(Action::Forward);
                    if s + 1 < stages {
                        deliveries.push((false, s + 1, mb));
                    } else {
                        deliveries.push((true, s, mb)); // loss gradient back to the last stage
                    }
                    format!("F{mb}")
                }
                Some(Action::Backward) => {
                    let mb = grads[s].remove(0);
                    state[s].record(Action::Backward);
                    if s > 0 {
                        deliveries.push((true, s - 1, mb));
                    }
                    format!("B{mb}")
                }
                None => ".".into(),
            };
            let in_flight = state[s].forwards - state[s].backwards;
            assert!(
                in_flight <= state[s].in_flight_limit(),
                "stage {s} exceeds its in-flight bound"
            );
            rows[s].push(cell);
        }
        for (is_grad, s, mb) in deliveries {
            if is_grad {
                grads[s].push(mb)
            } else {
                inputs[s].push(mb)
            }
        }
        time += 1;
    }
    rows
}

/// [`simulate`] as text, one line per stage.
pub fn table(schedule: Schedule, stages: usize, micro_batches: usize) -> String {
    simulate(schedule, stages, micro_batches)
        .iter()
        .enumerate()
        .map(|(s, row)| {
            format!(
                "stage {s}: {}",
                row.iter().map(|c| format!("{c:>3}")).collect::<String>()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    #[test]
    fn flushed_policy_steps_once_per_mini_batch_and_takes_only_its_own_tensors() {
        let mut p = StagePolicy::new(Schedule::OneFOneB, (1, 3), 2, 3, 7);
        assert!(p.accepts(7) && !p.accepts(8));
        assert_eq!(
            p.forward_at(1),
            ForwardAt {
                header_step: 7,
                id: 1,
                step: 7,
                micro: 1
            }
        );
        assert_eq!(p.next(true, false), Some(Action::Forward));
        assert_eq!(p.record(Action::Forward, 0), None);
        assert_eq!(p.record(Action::Forward, 1), None);
        assert_eq!(p.next(false, true), Some(Action::Backward));
        assert_eq!(p.record(Action::Backward, 0), None);
        assert_eq!(p.record(Action::Backward, 1), Some(7));
        assert!(p.accepts(8) && !p.accepts(7), "on to the next mini-batch");
    }

    #[test]
    fn async_policy_is_static_one_forward_one_backward_and_steps_after_each() {
        // Stage 1 of a window of 3: two micro-batches deep.
        let mut p = StagePolicy::new(Schedule::Async, (1, 3), 4, 3, 0);
        p.follow_drains(|_| 100);
        assert!(p.accepts(0) && p.accepts(99));
        assert_eq!(p.next(true, false), Some(Action::Forward));
        assert_eq!(p.record(Action::Forward, 0), None);
        // One deep: a gradient that came early waits for the next forward.
        assert_eq!(p.next(false, true), None);
        assert_eq!(p.next(true, true), Some(Action::Forward));
        assert_eq!(p.record(Action::Forward, 1), None);
        // Full: the backward, and an input that came early waits for it.
        assert_eq!(p.next(true, false), None);
        assert_eq!(p.next(true, true), Some(Action::Backward));
        assert_eq!(p.record(Action::Backward, 0), Some(0));
        assert_eq!(
            p.forward_at(9),
            ForwardAt {
                header_step: 9,
                id: 9,
                step: 2,
                micro: 1
            }
        );
        assert_eq!(p.backward_step(9), 9);
    }

    #[test]
    fn async_policy_drains_where_the_master_stops_forwarding() {
        let mut p = StagePolicy::new(Schedule::Async, (1, 2), 1, 4, 0);
        p.follow_drains(|_| 2);
        for id in 0..2 {
            assert_eq!(p.next(true, false), Some(Action::Forward));
            p.record(Action::Forward, id);
        }
        // Three deep, but the master sends nothing past micro-batch 1 before the drain.
        assert_eq!(p.next(false, true), Some(Action::Backward));
        p.record(Action::Backward, 0);
        p.follow_drains(|_| unreachable!("not at the drain yet"));
        assert_eq!(p.next(false, true), Some(Action::Backward));
        p.record(Action::Backward, 1);
        p.follow_drains(|k| {
            assert_eq!(k, 2);
            5
        });
        assert_eq!(p.next(false, true), None, "empty: a forward comes first");
    }

    /// Every stage of a ring whose nodes run at any speeds does each micro-batch's forward and
    /// backward after the same number of the stage's own backwards (its weight version): one
    /// seeded random interleaving after another, the versions are the same.
    #[test]
    fn async_weight_versions_are_the_same_whatever_the_timing() {
        let versions = |seed: u64| async_versions(4, 5, 23, seed);
        let first = versions(1);
        for seed in 2..40 {
            assert_eq!(versions(seed), first, "seed {seed}");
        }
        // PipeDream's: stage s forwards micro-batch k after k − (window − s) + 1 backwards.
        for (s, stage) in first.iter().enumerate() {
            let depth = (5 - s) as u64;
            for &(k, forward_version, _) in stage {
                assert_eq!(forward_version, (k + 1).saturating_sub(depth), "stage {s}");
            }
        }
    }

    /// Drives `stages` async stages (stage 0 the master, its window `window`) through `total`
    /// micro-batches, each step taken by a stage chosen by a seeded generator (any timing), and
    /// returns each stage's (micro-batch, backwards before its forward, backwards before its
    /// backward).
    fn async_versions(
        stages: usize,
        window: usize,
        total: u64,
        seed: u64,
    ) -> Vec<Vec<(u64, u64, u64)>> {
        let mut policies: Vec<StagePolicy> = (0..stages)
            .map(|s| StagePolicy::new(Schedule::Async, (s, stages), 1, window, 0))
            .collect();
        let mut inputs: Vec<VecDeque<u64>> = vec![VecDeque::new(); stages];
        let mut grads: Vec<VecDeque<u64>> = vec![VecDeque::new(); stages];
        let mut done = vec![0u64; stages];
        let mut seen: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); stages];
        let mut forward_version = vec![std::collections::HashMap::new(); stages];
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut fed = 0;
        let mut idle = 0;
        while done[0] < total {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let s = (state % stages as u64) as usize;
            if s == 0 && fed < total {
                inputs[0].push_back(fed);
                fed += 1;
            }
            let p = &mut policies[s];
            p.follow_drains(|_| total);
            let action = p.next(!inputs[s].is_empty(), !grads[s].is_empty());
            match action {
                Some(Action::Forward) => {
                    let k = inputs[s].pop_front().unwrap();
                    forward_version[s].insert(k, done[s]);
                    p.record(Action::Forward, k);
                    match s + 1 < stages {
                        true => inputs[s + 1].push_back(k),
                        false => grads[s].push_back(k),
                    }
                }
                Some(Action::Backward) => {
                    let k = grads[s].pop_front().unwrap();
                    seen[s].push((k, forward_version[s][&k], done[s]));
                    p.record(Action::Backward, k);
                    done[s] += 1;
                    if s > 0 {
                        grads[s - 1].push_back(k);
                    }
                }
                None => idle += 1,
            }
            assert!(idle < 1_000_000, "deadlocked");
        }
        seen
    }

    // Makespan 2(M + S − 1) for both, i.e. a bubble of (S − 1)/(M + S − 1) per stage; 1F1B holds at
    // most S − s micro-batches on stage s where GPipe holds all M.
    #[test]
    fn gpipe_table_fills_then_drains() {
        let t = table(Schedule::Gpipe, 3, 4);
        println!("{t}");
        assert_eq!(
            t,
            [
                "stage 0:  F0 F1 F2 F3  .  .  .  . B0 B1 B2 B3",
                "stage 1:   . F0 F1 F2 F3  .  . B0 B1 B2 B3  .",
                "stage 2:   .  . F0 F1 F2 F3 B0 B1 B2 B3  .  .",
            ]
            .join("\n")
        );
    }

    #[test]
    fn one_f_one_b_table_bounds_activations() {
        let t = table(Schedule::OneFOneB, 3, 6);
        println!("{t}");
        assert_eq!(
            t,
            [
                // Each stage holds at most one more micro-batch than the stages from it to the
                // end: the loss, on the master, is one more step of the ring's pipeline.
                "stage 0:  F0 F1 F2 F3  .  . B0 F4 B1 F5 B2  . B3  . B4 B5",
                "stage 1:   . F0 F1 F2  . B0 F3 B1 F4 B2 F5 B3  . B4 B5  .",
                "stage 2:   .  . F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5  .  .",
            ]
            .join("\n")
        );
    }

    #[test]
    fn schedules_complete_for_many_shapes() {
        for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
            for stages in 1..6 {
                for micro in 1..9 {
                    let rows = simulate(schedule, stages, micro);
                    for row in &rows {
                        assert_eq!(row.iter().filter(|c| c.starts_with('F')).count(), micro);
                        assert_eq!(row.iter().filter(|c| c.starts_with('B')).count(), micro);
                    }
                }
            }
        }
    }
}
