//! Consistency models of the parameter server as policy over one mechanism: a table of worker
//! positions in the data and a gate that says whether a worker may start an iteration. Sans-IO:
//! it takes events and times, returns decisions.
//!
//! A global iteration is `W` units of work (the `W` shares of one global mini-batch). A worker's
//! *position* is the iteration of the unit it works on:
//! - **fixed assignment** (BSP): worker `w` does share `w` of every iteration, so its position is
//!   the number of iterations it has pushed, whether it is computing or waiting;
//! - **dynamic assignment** (SSP, ASP, DSSP): units go out in order to whichever worker asks, so
//!   a worker holds a position only while it computes a unit; a straggler that finishes takes the
//!   next unit at the front instead of falling further behind.
//!
//! Contracts (worker `p` about to start a unit of iteration `t`; `m` is the smallest position
//! among live workers, or `t` when none is smaller; every unit of an iteration below `m` has been
//! pushed, because units go out in order):
//! - **SSP(s)** (Ho et al., NIPS 2013): start iff `t − m ≤ s` — every unit of iteration
//!   `t − s − 1` is pushed. **BSP** is SSP(0): lockstep. **ASP** never blocks.
//! - **DSSP(L, U)** (Zhao et al., ICDCS 2019): as SSP(L), except that a worker beyond the lower
//!   bound may run ahead on *credit*. When it reaches the bound without credit, the
//!   synchronisation controller predicts, from each worker's latest iteration interval (the
//!   difference of its last two push times), the requesting worker's next `r_max = U − L`
//!   iterations and the slowest worker's pushes, and grants the `r*` extra iterations that
//!   minimise the time the requesting worker would then wait for the slowest one's next push (the
//!   smallest `r` on ties). The gap never exceeds `U`.
//!
//! Why positions in the data rather than per-worker iteration counts under dynamic assignment:
//! with a *persistent* straggler, a bound on per-worker counts pins every worker to the
//! straggler's pace once the gap reaches the bound, so SSP and DSSP gain nothing over BSP beyond
//! their first `s` iterations (measured: DSSP 1.0× BSP with a quarter-speed worker). Handing the
//! straggler's share to the fast workers and bounding the gap in the data — FlexRR's remedy
//! (Harlap et al., SoCC 2016) — keeps the bound on how stale a read may be while the run moves at
//! the cluster's aggregate speed.
//!
//! Our reading of the controller, precisely: with `a` the requesting worker's latest push time
//! and `Δa` its interval, blocking after `r` more iterations happens at `A(r) = a + r·Δa`; with `b`
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

impl std::str::FromStr for Consistency {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::parse(text)
    }
}

impl std::fmt::Display for Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
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
    /// Units this worker has pushed.
    pushes: u64,
    /// Dynamic assignment: the iteration of the unit it computes, if any.
    holding: Option<u64>,
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

/// The position table and gate of one parameter-server run (module docs).
#[derive(Clone, Debug)]
pub struct Gate {
    consistency: Consistency,
    /// Fixed assignment: positions are push counts (module docs).
    fixed: bool,
    workers: Vec<Worker>,
    /// Histogram of observed staleness (`t − m` when an iteration starts), index = staleness.
    staleness: Vec<u64>,
}

impl Gate {
    /// A gate for `workers` workers, none started; fixed assignment under BSP, dynamic otherwise.
    pub fn new(consistency: Consistency, workers: usize) -> Self {
        Self {
            consistency,
            fixed: consistency == Consistency::Bsp,
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

    /// Whether units are assigned in a fixed pattern (BSP) rather than on demand.
    pub fn fixed_assignment(&self) -> bool {
        self.fixed
    }

    /// Worker `w` pushed the gradient of its current unit at time `now` (seconds).
    pub fn push(&mut self, w: usize, now: f64) {
        let worker = &mut self.workers[w];
        worker.pushes += 1;
        worker.holding = None;
        worker.prev_push = worker.last_push;
        worker.last_push = Some(now);
    }

    /// Removes a dead worker: nobody waits for it any more.
    pub fn drop_worker(&mut self, w: usize) {
        self.workers[w].alive = false;
        self.workers[w].holding = None;
    }

    /// Units worker `w` has pushed (under fixed assignment, also its position).
    pub fn pushes(&self, w: usize) -> u64 {
        self.workers[w].pushes
    }

    fn position(&self, w: &Worker) -> Option<u64> {
        if !w.alive {
            None
        } else if self.fixed {
            Some(w.pushes)
        } else {
            w.holding
        }
    }

    /// The smallest position among live workers (`None` when nobody holds one).
    pub fn min_position(&self) -> Option<u64> {
        self.workers.iter().filter_map(|w| self.position(w)).min()
    }

    /// Index of the live worker at the smallest position (the lowest index on ties).
    fn slowest_worker(&self) -> Option<usize> {
        let m = self.min_position()?;
        self.workers
            .iter()
            .position(|w| self.position(w) == Some(m))
    }

    /// Observed staleness counts, index = how far ahead of the slowest a worker started.
    pub fn staleness_histogram(&self) -> &[u64] {
        &self.staleness
    }

    /// The same counts for worker `w` alone.
    pub fn worker_staleness(&self, w: usize) -> &[u64] {
        &self.workers[w].staleness
    }

    /// May worker `w` start a unit of iteration `t` now (under fixed assignment `t` is
    /// [`Gate::pushes`]`(w)`)? On `Proceed` the start is recorded: the worker holds position `t`,
    /// the staleness `t − m` enters the histograms, and DSSP credit is spent.
    pub fn may_start(&mut self, w: usize, t: u64, now: f64) -> Decision {
        let m = self.min_position().map_or(t, |m| m.min(t));
        let ahead = t - m;
        let decision = match self.consistency {
            Consistency::Asp => Decision::Proceed,
            Consistency::Bsp => Self::bound(ahead, 0),
            Consistency::Ssp { staleness } => Self::bound(ahead, staleness),
            Consistency::Dssp { lower, upper } => self.dssp(w, ahead, lower, upper, now),
        };
        if decision == Decision::Proceed {
            if !self.fixed {
                self.workers[w].holding = Some(t);
            }
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
            let slowest = self
                .slowest_worker()
                .and_then(|v| Some((self.workers[v].last_push?, self.workers[v].interval()?)));
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
    fn bsp_is_lockstep() {
        let mut g = Gate::new(Consistency::Bsp, 2);
        assert_eq!(g.may_start(0, 0, 0.0), Decision::Proceed);
        g.push(0, 1.0);
        // Worker 1 has not even started iteration 0: its position is 0.
        assert_eq!(g.may_start(0, 1, 1.0), Decision::Wait);
        assert_eq!(g.may_start(1, 0, 1.5), Decision::Proceed);
        g.push(1, 2.0);
        assert_eq!(g.may_start(0, 1, 2.0), Decision::Proceed);
    }

    /// SSP(0) under dynamic assignment is lockstep too: the units of iteration 1 wait for every
    /// unit of iteration 0, whoever computes them.
    #[test]
    fn ssp_zero_waits_for_every_unit_of_the_previous_iteration() {
        let mut g = Gate::new(Consistency::Ssp { staleness: 0 }, 2);
        assert_eq!(g.may_start(0, 0, 0.0), Decision::Proceed);
        assert_eq!(g.may_start(1, 0, 0.0), Decision::Proceed);
        g.push(0, 1.0);
        assert_eq!(g.may_start(0, 1, 1.0), Decision::Wait);
        g.push(1, 2.0);
        assert_eq!(g.may_start(0, 1, 2.0), Decision::Proceed);
        assert_eq!(g.staleness_histogram(), &[3]);
    }

    /// What a simulated run did.
    struct Simulated {
        /// Virtual time when the last unit was pushed.
        makespan: f64,
        /// Requests the gate answered with `Wait`.
        waits: u64,
        gate: Gate,
    }

    impl Simulated {
        fn most_ahead(&self) -> u64 {
            self.gate.staleness_histogram().len() as u64 - 1
        }
    }

    /// A simulated cluster: 4 workers with seeded random unit times, worker 3 a persistent 4×
    /// straggler, virtual time, the gate in the middle. Units go out as server 0 hands them out:
    /// under fixed assignment worker `w` does share `w` of every iteration; under dynamic
    /// assignment the next unit in order goes to whichever worker asks.
    fn simulate(consistency: Consistency, seed: u64, iterations: u64) -> Simulated {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let workers = 4u64;
        let mut gate = Gate::new(consistency, workers as usize);
        let fixed = gate.fixed_assignment();
        // (time the worker's current unit ends, or None while it waits at the gate)
        let mut busy: Vec<Option<f64>> = vec![None; workers as usize];
        let speed = [1.0, 1.0, 1.3, 4.0];
        let (mut now, mut waits, mut next_unit, mut steps) = (0.0f64, 0, 0u64, 0);
        let total = iterations * workers;
        loop {
            steps += 1;
            assert!(steps < 100_000, "simulation did not finish (deadlock?)");
            // Everyone idle with work left tries to start.
            for w in 0..workers as usize {
                let t = if fixed {
                    gate.pushes(w)
                } else {
                    next_unit / workers
                };
                let has_work = if fixed {
                    t < iterations
                } else {
                    next_unit < total
                };
                if busy[w].is_some() || !has_work {
                    continue;
                }
                if gate.may_start(w, t, now) == Decision::Proceed {
                    next_unit += 1;
                    busy[w] = Some(now + speed[w] * (0.5 + rng.random::<f64>()));
                } else {
                    waits += 1;
                }
            }
            // Advance to the next unit's end.
            let Some((w, t)) = busy
                .iter()
                .enumerate()
                .filter_map(|(w, b)| b.map(|t| (w, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
            else {
                assert!(
                    next_unit >= total,
                    "everybody waits: deadlock under {consistency:?}"
                );
                break;
            };
            now = t;
            busy[w] = None;
            gate.push(w, now);
        }
        assert_eq!(
            (0..workers as usize).map(|w| gate.pushes(w)).sum::<u64>(),
            total
        );
        Simulated {
            makespan: now,
            waits,
            gate,
        }
    }

    #[test]
    fn staleness_bounds_hold_under_random_delays() {
        let seed: u64 = std::env::var("RINGTMP_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7);
        println!("RINGTMP_SEED={seed}");
        for seed in seed..seed + 20 {
            let bsp = simulate(Consistency::Bsp, seed, 60);
            assert_eq!(bsp.most_ahead(), 0, "bsp seed {seed}");
        }
        for s in 0..4u32 {
            let mut reached = false;
            for seed in seed..seed + 20 {
                let ahead = simulate(Consistency::Ssp { staleness: s }, seed, 60).most_ahead();
                assert!(
                    ahead <= u64::from(s),
                    "ssp:{s} seed {seed}: a worker ran {ahead} ahead"
                );
                reached |= ahead == u64::from(s);
            }
            assert!(reached, "ssp:{s} never used its staleness");
        }
        for (l, u) in [(0, 2), (1, 4), (2, 6)] {
            let mut used_credit = false;
            for seed in seed..seed + 20 {
                let ahead =
                    simulate(Consistency::Dssp { lower: l, upper: u }, seed, 60).most_ahead();
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
        // ASP never blocks.
        for seed in seed..seed + 20 {
            assert_eq!(
                simulate(Consistency::Asp, seed, 60).waits,
                0,
                "asp seed {seed}"
            );
        }
    }

    /// The reason for dynamic assignment (module docs): with a persistent 4× straggler BSP moves
    /// at the straggler's pace, while bounded staleness keeps near ASP's (the aggregate speed).
    #[test]
    fn bounded_staleness_is_not_pinned_to_a_persistent_straggler() {
        let bsp = simulate(Consistency::Bsp, 3, 60).makespan;
        let asp = simulate(Consistency::Asp, 3, 60).makespan;
        for c in [
            Consistency::Ssp { staleness: 3 },
            Consistency::Dssp { lower: 1, upper: 6 },
        ] {
            let run = simulate(c, 3, 60).makespan;
            println!(
                "{}: makespan {run:.1}, bsp {bsp:.1}, asp {asp:.1}",
                c.name()
            );
            assert!(run < 0.5 * bsp, "{}: {run:.1} vs bsp {bsp:.1}", c.name());
            assert!(run < 1.3 * asp, "{}: {run:.1} vs asp {asp:.1}", c.name());
        }
    }

    #[test]
    fn dropped_worker_no_longer_holds_others_back() {
        for c in [Consistency::Bsp, Consistency::Ssp { staleness: 0 }] {
            let mut g = Gate::new(c, 3);
            for w in 0..3 {
                assert_eq!(g.may_start(w, 0, 0.0), Decision::Proceed);
            }
            g.push(0, 1.0);
            g.push(1, 1.0);
            assert_eq!(g.may_start(0, 1, 1.0), Decision::Wait, "{c:?}");
            g.drop_worker(2);
            assert_eq!(g.may_start(0, 1, 1.0), Decision::Proceed, "{c:?}");
        }
    }
}
