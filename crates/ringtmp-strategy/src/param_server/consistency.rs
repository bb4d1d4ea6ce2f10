//! Consistency models of the parameter server as policy over one mechanism: a table of worker
//! clocks (iterations whose gradients the servers have received) and a gate that says whether a
//! worker may start its next iteration. Sans-IO: it takes events and times, returns decisions.
//!
//! Contracts (worker `p` about to start iteration `t`, i.e. it has pushed `t` gradients; `m` is the
//! smallest clock among live workers):
//! - **SSP(s)** (Ho et al., NIPS 2013): start iff `t − m ≤ s` — the slowest worker has finished
//!   iteration `t − s − 1`. **BSP** is SSP(0): lockstep. **ASP** never blocks.
//! - **DSSP(L, U)** (Zhao et al., ICDCS 2019): as SSP(L), except that a worker beyond the lower
//!   bound may run ahead on *credit*. When it reaches the bound without credit, the
//!   synchronisation controller predicts, from each worker's latest iteration interval (the
//!   difference of its last two push times), the fastest worker's next `r_max = U − L` iterations
//!   and the slowest worker's pushes, and grants the `r*` extra iterations that minimise the time
//!   the fastest worker would then wait for the slowest one's next push (the smallest `r` on ties).
//!   The gap never exceeds `U`.
//!
//! Our reading of the controller, precisely: with `a` the fastest worker's latest push time and
//! `Δa` its interval, blocking after `r` more iterations happens at `A(r) = a + r·Δa`; with `b`
//! and `Δb` the slowest worker's, its first push at or after `A(r)` is
//! `B(r) = b + ⌈(A(r) − b)/Δb⌉·Δb` (at least `b + Δb`); the predicted wait is `B(r) − A(r)`.

use serde::{Deserialize, Serialize};

/// A consistency model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Asynchronous: never wait.
    Asp,
    /// Bulk synchronous: lockstep (SSP with staleness 0).
    Bsp,
    /// Dynamic stale synchronous parallel with staleness between `lower` and `upper`.
    Dssp {
        /// Staleness allowed without credit.
        lower: u32,
        /// Staleness never exceeded.
        upper: u32,
    },
    /// Stale synchronous parallel.
    Ssp {
        /// Most iterations a worker may be ahead of the slowest.
        staleness: u32,
    },
}

impl Consistency {
    /// Parses `bsp`, `asp`, `ssp:S` or `dssp:L:U`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("unknown consistency {text:?}; use bsp, asp, ssp:S or dssp:L:U");
        let number = |s: &str| s.parse::<u32>().map_err(|_| bad());
        match text.split(':').collect::<Vec<_>>()[..] {
            ["bsp"] => Ok(Self::Bsp),
            ["asp"] => Ok(Self::Asp),
            ["ssp", s] => Ok(Self::Ssp {
                staleness: number(s)?,
            }),
            ["dssp", l, u] => {
                let (lower, upper) = (number(l)?, number(u)?);
                if lower > upper {
                    return Err(format!(
                        "dssp:{lower}:{upper}: the lower bound exceeds the upper"
                    ));
                }
                Ok(Self::Dssp { lower, upper })
            }
            _ => Err(bad()),
        }
    }

    /// Name as on the command line.
    pub fn name(&self) -> String {
        match *self {
            Self::Asp => "asp".into(),
            Self::Bsp => "bsp".into(),
            Self::Ssp { staleness } => format!("ssp:{staleness}"),
            Self::Dssp { lower, upper } => format!("dssp:{lower}:{upper}"),
        }
    }
}

/// What the gate tells a worker that wants to start an iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Go ahead.
    Proceed,
    /// Wait until the slowest worker pushes.
    Wait,
}

#[derive(Clone, Debug, Default)]
struct Worker {
    clock: u64,
    /// This worker's observed staleness counts (index = iterations ahead of the slowest).
    staleness: Vec<u64>,
    last_push: Option<f64>,
    prev_push: Option<f64>,
    credit: u32,
    alive: bool,
}

impl Worker {
    fn interval(&self) -> Option<f64> {
        Some(self.last_push? - self.prev_push?).filter(|d| *d > 0.0)
    }
}

/// The clock table and gate of one parameter-server run.
#[derive(Clone, Debug)]
pub struct Gate {
    consistency: Consistency,
    workers: Vec<Worker>,
    /// Histogram of observed staleness (`t − m` when an iteration starts), index = staleness.
    staleness: Vec<u64>,
}

impl Gate {
    /// A gate for `workers` workers, all at clock 0.
    pub fn new(consistency: Consistency, workers: usize) -> Self {
        Self {
            consistency,
            workers: vec![
                Worker {
                    alive: true,
                    ..Default::default()
                };
                workers
            ],
            staleness: Vec::new(),
        }
    }

    /// The consistency model.
    pub fn consistency(&self) -> Consistency {
        self.consistency
    }

    /// Worker `w` pushed the gradient of its current iteration at time `now` (seconds).
    pub fn push(&mut self, w: usize, now: f64) {
        let worker = &mut self.workers[w];
        worker.clock += 1;
        worker.prev_push = worker.last_push;
        worker.last_push = Some(now);
    }

    /// Removes a dead worker: nobody waits for it any more.
    pub fn drop_worker(&mut self, w: usize) {
        self.workers[w].alive = false;
    }

    /// Iterations whose gradients worker `w` has pushed.
    pub fn clock(&self, w: usize) -> u64 {
        self.workers[w].clock
    }

    /// The smallest clock among live workers (`u64::MAX` when none is left).
    pub fn min_clock(&self) -> u64 {
        self.workers
            .iter()
            .filter(|w| w.alive)
            .map(|w| w.clock)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Observed staleness counts, index = how far ahead of the slowest a worker started.
    pub fn staleness_histogram(&self) -> &[u64] {
        &self.staleness
    }

    /// The same counts for worker `w` alone.
    pub fn worker_staleness(&self, w: usize) -> &[u64] {
        &self.workers[w].staleness
    }

    /// May worker `w` start its next iteration now? On `Proceed` the start is recorded in the
    /// staleness histogram (and DSSP credit is spent).
    pub fn may_start(&mut self, w: usize, now: f64) -> Decision {
        let t = self.workers[w].clock;
        let m = self.min_clock();
        let ahead = t.saturating_sub(m);
        let decision = match self.consistency {
            Consistency::Asp => Decision::Proceed,
            Consistency::Bsp => Self::bound(ahead, 0),
            Consistency::Ssp { staleness } => Self::bound(ahead, staleness),
            Consistency::Dssp { lower, upper } => self.dssp(w, ahead, lower, upper, now),
        };
        if decision == Decision::Proceed {
            let slot = ahead as usize;
            for histogram in [&mut self.staleness, &mut self.workers[w].staleness] {
                if histogram.len() <= slot {
                    histogram.resize(slot + 1, 0);
                }
                histogram[slot] += 1;
            }
        }
        decision
    }

    fn bound(ahead: u64, staleness: u32) -> Decision {
        if ahead <= u64::from(staleness) {
            Decision::Proceed
        } else {
            Decision::Wait
        }
    }

    fn dssp(&mut self, w: usize, ahead: u64, lower: u32, upper: u32, now: f64) -> Decision {
        if ahead <= u64::from(lower) {
            return Decision::Proceed;
        }
        if ahead > u64::from(upper) {
            return Decision::Wait;
        }
        if self.workers[w].credit == 0 {
            // Beyond the lower bound without credit: ask the controller, once per arrival there.
            let slowest = self.slowest();
            let granted = match (
                self.workers[w].last_push,
                self.workers[w].interval(),
                slowest,
            ) {
                (Some(a), Some(da), Some((b, db))) => {
                    // At most the room left below the upper bound.
                    let room = (u64::from(upper) - ahead + 1).min(u64::from(upper - lower)) as u32;
                    controller(a.max(now), da, b, db, room)
                }
                _ => 0,
            };
            self.workers[w].credit = granted;
        }
        if self.workers[w].credit > 0 {
            self.workers[w].credit -= 1;
            Decision::Proceed
        } else {
            Decision::Wait
        }
    }

    /// Latest push time and interval of the slowest live worker, if it has pushed twice.
    fn slowest(&self) -> Option<(f64, f64)> {
        let m = self.min_clock();
        let w = self.workers.iter().find(|w| w.alive && w.clock == m)?;
        Some((w.last_push?, w.interval()?))
    }
}

/// The DSSP synchronisation controller: the number of extra iterations `r* ∈ [0, r_max]` that
/// minimises the fastest worker's predicted wait (module docs), smallest on ties.
pub fn controller(a: f64, da: f64, b: f64, db: f64, r_max: u32) -> u32 {
    let wait = |r: u32| {
        let ar = a + f64::from(r) * da;
        let k = ((ar - b) / db).ceil().max(1.0);
        b + k * db - ar
    };
    (0..=r_max)
        .fold((0, f64::INFINITY), |(best, w), r| {
            let wr = wait(r);
            if wr < w - 1e-12 { (r, wr) } else { (best, w) }
        })
        .0
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn parse_and_name() {
        for text in ["bsp", "asp", "ssp:3", "dssp:2:6"] {
            assert_eq!(Consistency::parse(text).unwrap().name(), text);
        }
        for bad in ["ssp", "dssp:5:2", "ssp:x", "bssp"] {
            assert!(Consistency::parse(bad).is_err(), "{bad}");
        }
    }

    /// Hand-computed controller cases: (a, Δa, b, Δb, r_max) → r*.
    #[test]
    fn controller_table() {
        let cases = [
            // Fast pushes every 1 s (last at 10), slow every 4 s (last at 8, next at 12).
            // r = 0 blocks at 10, waits until 12 (2 s); r = 1 → 11 waits 1; r = 2 → 12 waits 0.
            (10.0, 1.0, 8.0, 4.0, 4, 2),
            // Same, but only one extra iteration allowed: best is r = 1 (waits 1 s).
            (10.0, 1.0, 8.0, 4.0, 1, 1),
            // Slow worker about to push (next at 10.5): waiting 0.5 s now beats r = 1 (11 → 14.5,
            // 3.5 s) and r = 2 (12 → 14.5, 2.5 s).
            (10.0, 1.0, 6.5, 4.0, 2, 0),
            // Equal speeds, slow one pushed at the same instant: next at 11, r = 1 waits 0.
            (10.0, 1.0, 10.0, 1.0, 3, 1),
            // Ties go to the smallest r: fast 2 s, slow 2 s, slow next at 11 → r = 0 waits 1,
            // r = 1 (12) waits 1 (slow at 13) → r* = 0.
            (10.0, 2.0, 9.0, 2.0, 3, 0),
        ];
        for (a, da, b, db, r_max, want) in cases {
            assert_eq!(
                controller(a, da, b, db, r_max),
                want,
                "a={a} Δa={da} b={b} Δb={db} r_max={r_max}"
            );
        }
    }

    #[test]
    fn bsp_is_lockstep_and_ssp_zero_equals_bsp() {
        for c in [Consistency::Bsp, Consistency::Ssp { staleness: 0 }] {
            let mut g = Gate::new(c, 2);
            assert_eq!(g.may_start(0, 0.0), Decision::Proceed);
            g.push(0, 1.0);
            assert_eq!(g.may_start(0, 1.0), Decision::Wait, "{c:?}");
            g.push(1, 2.0);
            assert_eq!(g.may_start(0, 2.0), Decision::Proceed);
        }
    }

    /// A simulated cluster: workers with seeded random iteration times (one straggler), virtual
    /// time, the gate in the middle. Returns per worker its clock at the end and the most it
    /// was ever ahead of the slowest at an iteration start.
    fn simulate(consistency: Consistency, seed: u64, iterations: u64) -> (Vec<u64>, u64, Gate) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let workers = 4;
        let mut gate = Gate::new(consistency, workers);
        // (time the worker's current iteration ends, or None while it waits at the gate)
        let mut busy: Vec<Option<f64>> = vec![None; workers];
        let speed = [1.0, 1.0, 1.3, 4.0];
        let mut now = 0.0f64;
        let mut max_ahead = 0u64;
        let mut steps = 0;
        while (0..workers).any(|w| gate.clock(w) < iterations) {
            steps += 1;
            assert!(steps < 100_000, "simulation did not finish (deadlock?)");
            // Everyone idle tries to start.
            for w in 0..workers {
                if busy[w].is_none() && gate.clock(w) < iterations {
                    let ahead = gate.clock(w).saturating_sub(gate.min_clock());
                    if gate.may_start(w, now) == Decision::Proceed {
                        max_ahead = max_ahead.max(ahead);
                        busy[w] = Some(now + speed[w] * (0.5 + rng.random::<f64>()));
                    }
                }
            }
            // Advance to the next iteration end.
            let Some((w, t)) = busy
                .iter()
                .enumerate()
                .filter_map(|(w, b)| b.map(|t| (w, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
            else {
                panic!("everybody waits: deadlock under {consistency:?}");
            };
            now = t;
            busy[w] = None;
            gate.push(w, now);
        }
        (
            (0..workers).map(|w| gate.clock(w)).collect(),
            max_ahead,
            gate,
        )
    }

    #[test]
    fn staleness_bounds_hold_under_random_delays() {
        let seed: u64 = std::env::var("RINGTMP_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7);
        println!("RINGTMP_SEED={seed}");
        for s in 0..4u32 {
            for seed in seed..seed + 20 {
                let (_, ahead, _) = simulate(Consistency::Ssp { staleness: s }, seed, 60);
                assert!(
                    ahead <= u64::from(s),
                    "ssp:{s} seed {seed}: a worker ran {ahead} ahead"
                );
            }
        }
        for (l, u) in [(0, 2), (1, 4), (2, 6)] {
            let mut used_credit = false;
            for seed in seed..seed + 20 {
                let (_, ahead, _) = simulate(Consistency::Dssp { lower: l, upper: u }, seed, 60);
                assert!(
                    ahead <= u64::from(u),
                    "dssp:{l}:{u} seed {seed}: {ahead} ahead"
                );
                used_credit |= ahead > u64::from(l);
            }
            assert!(
                used_credit,
                "dssp:{l}:{u} never went beyond its lower bound"
            );
        }
        // ASP never blocks: the fast workers finish long before the straggler.
        let (clocks, ahead, _) = simulate(Consistency::Asp, seed, 60);
        assert!(clocks.iter().all(|c| *c == 60));
        assert!(
            ahead > 10,
            "asp should let the fast workers run ahead, saw {ahead}"
        );
    }

    #[test]
    fn dropped_worker_no_longer_holds_others_back() {
        let mut g = Gate::new(Consistency::Bsp, 3);
        for w in 0..3 {
            assert_eq!(g.may_start(w, 0.0), Decision::Proceed);
        }
        g.push(0, 1.0);
        g.push(1, 1.0);
        assert_eq!(g.may_start(0, 1.0), Decision::Wait);
        g.drop_worker(2);
        assert_eq!(g.may_start(0, 1.0), Decision::Proceed);
    }
}
