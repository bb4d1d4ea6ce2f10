//! A run-wide bound on waiting without progress, for the node that keeps the run's steps.
//!
//! Liveness is per link: heartbeats say a peer's process is there, not that the run moves. A
//! ring whose nodes are all alive but each waiting for another (a protocol fault, a frozen
//! thread) would otherwise wait out every receive timeout. The node that records the run's steps
//! arms a [`StepWatch`]: once it knows how long a step takes (the plan's prediction, then the
//! slowest step it has seen), none of its receives may wait longer than `factor` times that, and
//! never less than `floor`. A receive that runs past the bound ends with
//! [`TransportError::NoProgress`](crate::TransportError::NoProgress), naming what this node
//! waited for; the abort it sends makes every other node name its own wait.
//!
//! Invariants: the bound only ever shortens a receive (a caller's own, shorter wait stands);
//! time the node spends computing (an evaluation, a checkpoint) is never counted against it,
//! since each receive is bounded from its own start; before the watch knows a step's length it
//! bounds nothing.

use std::time::Duration;

/// What a watched node may wait for, in terms of its steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepBound {
    /// The least bound, whatever the steps take: longer than the links' failure detection, so
    /// that a dead peer is reported as dead rather than as a stall.
    pub floor: Duration,
    /// Multiple of the slowest step so far (or the predicted one) a wait may last.
    pub factor: u32,
    /// The plan's prediction of one step, used until two steps have been seen.
    pub predicted_step: Option<Duration>,
}

impl StepBound {
    /// The default: 20 steps, and at least 30 s or six times the links' `peer_timeout`.
    pub fn new(peer_timeout: Duration, predicted_step: Option<Duration>) -> Self {
        Self {
            floor: Duration::from_secs(30).max(peer_timeout * 6),
            factor: 20,
            predicted_step,
        }
    }
}

/// Steps seen by a watched node, on any clock (times are offsets from the watch's start).
#[derive(Clone, Debug)]
pub struct StepWatch {
    bound: StepBound,
    last_step: Option<Duration>,
    slowest: Option<Duration>,
    steps: u64,
}

impl StepWatch {
    /// A watch with nothing seen yet.
    pub fn new(bound: StepBound) -> Self {
        Self {
            bound,
            last_step: None,
            slowest: None,
            steps: 0,
        }
    }

    /// A step completed at `now`. The time from the watch's start to the first step (warm-up,
    /// profiling) is not a step's length.
    pub fn step_done(&mut self, now: Duration) {
        if let Some(last) = self.last_step {
            let took = now.saturating_sub(last);
            self.slowest = Some(self.slowest.map_or(took, |s| s.max(took)));
        }
        self.last_step = Some(now);
        self.steps += 1;
    }

    /// The step the bound is a multiple of, and what it is.
    fn step(&self) -> Option<(Duration, &'static str)> {
        match (self.slowest, self.bound.predicted_step) {
            (Some(s), _) => Some((s, "the slowest step so far")),
            (None, Some(p)) => Some((p, "the plan's predicted step")),
            (None, None) => None,
        }
    }

    /// The longest a receive may wait now (`None`: not bounded yet). Cheap: every receive of
    /// the watched node asks.
    pub fn limit(&self) -> Option<Duration> {
        self.step()
            .map(|(step, _)| (step * self.bound.factor).max(self.bound.floor))
    }

    /// How [`StepWatch::limit`] is derived, in words (for the error that reports a stall).
    pub fn explain(&self) -> String {
        match self.step() {
            Some((step, what)) => format!(
                "{} × {what} of {:.3} s, and at least {:.0} s",
                self.bound.factor,
                step.as_secs_f64(),
                self.bound.floor.as_secs_f64()
            ),
            None => "none yet".into(),
        }
    }

    /// Time since the last step at `now` (since the watch's start before the first).
    pub fn since_last_step(&self, now: Duration) -> Duration {
        now.saturating_sub(self.last_step.unwrap_or_default())
    }

    /// Steps seen.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn nothing_is_bounded_until_a_step_length_is_known() {
        let mut w = StepWatch::new(StepBound::new(ms(5_000), None));
        assert!(w.limit().is_none());
        // The first step's time from the start is warm-up, not a step.
        w.step_done(ms(90_000));
        assert!(w.limit().is_none());
        w.step_done(ms(90_010));
        assert_eq!(
            w.limit(),
            Some(Duration::from_secs(30)),
            "the floor: 20 × 10 ms is less"
        );
        let why = w.explain();
        assert!(why.contains("slowest step so far"), "{why}");
    }

    #[test]
    fn the_bound_follows_the_slowest_step_and_the_links_failure_detection() {
        let mut w = StepWatch::new(StepBound::new(ms(5_000), Some(ms(100))));
        assert_eq!(w.limit(), Some(Duration::from_secs(30)));
        let why = w.explain();
        assert!(why.contains("predicted"), "{why}");
        w.step_done(ms(1_000));
        w.step_done(ms(3_000)); // 2 s
        w.step_done(ms(3_500)); // 0.5 s: the slowest stays
        assert_eq!(w.limit(), Some(Duration::from_secs(40)));
        assert_eq!(w.since_last_step(ms(4_000)), ms(500));
        assert_eq!(w.steps(), 3);
        // Slow failure detection raises the floor: a dead peer is found before a stall.
        let slow = StepWatch::new(StepBound::new(Duration::from_secs(20), Some(ms(1))));
        assert_eq!(slow.limit(), Some(Duration::from_secs(120)));
    }
}
