//! When a parameter server answers a worker's pull, and with which unit of work: the consistency
//! gate, server 0's assignment of units, and the grants that keep every shard a worker reads as
//! fresh as the gate required. Sans-IO: events in (pulls, pushes, grants, departures, with the
//! time), [`Reply`]s out, which the driver sends.
//!
//! Who decides what:
//! - **BSP**: every server runs the same gate on the workers' push counts, and worker `w`'s unit
//!   of iteration `t` is fixed (`t·W + w`), so the run is exactly large-batch SGD.
//! - **SSP, ASP, DSSP**: server 0 runs the gate on positions in the data
//!   ([`super::consistency`]) and hands out units in order to whichever worker asks. Under SSP and
//!   DSSP it sends every other server, per answer, a grant: the unit and the `settled` mark below
//!   which every unit had been pushed to server 0 (or abandoned by a departed worker). Another
//!   server answers that worker once none of the units it has served below the mark is still
//!   unpushed *to it*. A unit below the mark was pushed to server 0, so its worker had pulled it
//!   from this server first, so this server knows it: the rule needs no other knowledge. Under
//!   ASP nobody waits and no grants are sent.
//!
//! Invariants: a pull is answered exactly once; a parked pull is retried after every event that
//! can release it, in arrival order; a departed worker holds no unit and no parked pull.

use std::collections::{BTreeMap, VecDeque};

use super::consistency::{Consistency, Decision, Gate};

/// `Params` answers carry, from server 0, the unit of work the worker does next: unit `u` is share
/// `u mod W` of global batch `u div W`. This marks the end of the run instead.
pub const NO_MORE_WORK: u64 = u64::MAX;

/// What the driver must send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// This server's shard to `worker` for its iteration `clock`, tagged with `unit` (server 0's
    /// assignment; 0 from the other servers).
    Params {
        /// Worker index.
        worker: usize,
        /// The worker's iteration (pushes so far).
        clock: u64,
        /// Its next unit of work.
        unit: u64,
    },
    /// Server 0 to server `to`: `worker` was given `unit`, and every unit below `settled` had been
    /// pushed to server 0.
    Grant {
        /// Server index.
        to: usize,
        /// Worker index.
        worker: usize,
        /// The unit given.
        unit: u64,
        /// The settled mark.
        settled: u64,
    },
}

/// Server 0's assignment of work (module docs).
#[derive(Clone, Debug)]
struct Units {
    workers: u64,
    /// The first unit of this run (after a resume, the checkpoint's step · W).
    first: u64,
    total: u64,
    next: u64,
    /// Dynamic assignment: the unit each worker computes, if any.
    held: Vec<Option<u64>>,
}

impl Units {
    /// Worker `w`'s unit of its iteration `clock` under fixed assignment.
    fn fixed(&self, w: usize, clock: u64) -> u64 {
        let unit = self.first + clock * self.workers + w as u64;
        if unit >= self.total {
            NO_MORE_WORK
        } else {
            unit
        }
    }

    fn exhausted(&self) -> bool {
        self.next >= self.total
    }

    /// The global iteration of the next unit to hand out.
    fn next_iteration(&self) -> u64 {
        self.next / self.workers
    }

    /// Every unit below this has been pushed or abandoned (units go out in order).
    fn settled(&self) -> u64 {
        self.held.iter().flatten().fold(self.next, |m, u| m.min(*u))
    }

    /// Hands worker `w` the next unit.
    fn assign(&mut self, w: usize) -> u64 {
        let unit = self.next;
        self.next += 1;
        self.held[w] = Some(unit);
        unit
    }

    /// Worker `w` pushed its unit, or left.
    fn release(&mut self, w: usize) {
        self.held[w] = None;
    }
}

/// One server's admission of pulls (module docs).
#[derive(Clone, Debug)]
pub struct Admission {
    s: usize,
    servers: usize,
    gate: Gate,
    /// Server 0: the assignment of work.
    units: Units,
    parked: VecDeque<(usize, u64)>,
    parked_count: u64,
    /// Other servers: per worker, server 0's grant for its next pull (unit, settled).
    grants: BTreeMap<usize, (u64, u64)>,
    /// Other servers: units whose shard went out and whose gradient has not arrived, by worker.
    outstanding: BTreeMap<u64, usize>,
}

impl Admission {
    /// Server `s` of `servers`, for `workers` workers doing units `first..total`.
    pub fn new(
        consistency: Consistency,
        s: usize,
        servers: usize,
        workers: usize,
        units: std::ops::Range<u64>,
    ) -> Self {
        Self {
            s,
            servers,
            gate: Gate::new(consistency, workers),
            units: Units {
                workers: workers as u64,
                first: units.start,
                total: units.end,
                next: units.start,
                held: vec![None; workers],
            },
            parked: VecDeque::new(),
            parked_count: 0,
            grants: BTreeMap::new(),
            outstanding: BTreeMap::new(),
        }
    }

    /// The gate (clocks, staleness histograms).
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// Pulls that could not be answered when they arrived.
    pub fn parked_count(&self) -> u64 {
        self.parked_count
    }

    /// Worker `w` asks for its iteration `clock` at time `now`: answered now or parked.
    pub fn pull(&mut self, w: usize, clock: u64, now: f64) -> Vec<Reply> {
        let mut replies = Vec::new();
        if !self.try_answer(w, clock, now, &mut replies) {
            self.parked_count += 1;
            self.parked.push_back((w, clock));
        }
        replies
    }

    /// Server 0's grant arrived (another server, SSP/DSSP).
    pub fn grant(&mut self, w: usize, unit: u64, settled: u64, now: f64) -> Vec<Reply> {
        self.grants.insert(w, (unit, settled));
        self.retry(now)
    }

    /// Worker `w` pushed the gradient of `unit`.
    pub fn pushed(&mut self, w: usize, unit: u64, now: f64) -> Vec<Reply> {
        self.gate.push(w, now);
        self.units.release(w);
        self.outstanding.remove(&unit);
        self.retry(now)
    }

    /// Worker `w` finished or died: nobody waits for it any more (a unit it held is skipped).
    pub fn drop_worker(&mut self, w: usize, now: f64) -> Vec<Reply> {
        self.gate.drop_worker(w);
        self.units.release(w);
        self.outstanding.retain(|_, v| *v != w);
        self.grants.remove(&w);
        self.parked.retain(|(v, _)| *v != w);
        self.retry(now)
    }

    /// Answers parked pulls that may go now, in arrival order.
    fn retry(&mut self, now: f64) -> Vec<Reply> {
        let mut replies = Vec::new();
        for _ in 0..self.parked.len() {
            let Some((w, clock)) = self.parked.pop_front() else {
                break;
            };
            if !self.try_answer(w, clock, now, &mut replies) {
                self.parked.push_back((w, clock));
            }
        }
        replies
    }

    fn try_answer(&mut self, w: usize, clock: u64, now: f64, replies: &mut Vec<Reply>) -> bool {
        if self.gate.fixed_assignment() {
            if self.gate.may_start(w, clock, now) == Decision::Wait {
                return false;
            }
            let unit = if self.s == 0 {
                self.units.fixed(w, clock)
            } else {
                0
            };
            replies.push(Reply::Params {
                worker: w,
                clock,
                unit,
            });
            return true;
        }
        if self.s == 0 {
            let (unit, settled) = if self.units.exhausted() {
                (NO_MORE_WORK, self.units.settled())
            } else {
                let t = self.units.next_iteration();
                if self.gate.may_start(w, t, now) == Decision::Wait {
                    return false;
                }
                let settled = self.units.settled();
                (self.units.assign(w), settled)
            };
            replies.push(Reply::Params {
                worker: w,
                clock,
                unit,
            });
            if self.gate.consistency() != Consistency::Asp {
                replies.extend((1..self.servers).map(|to| Reply::Grant {
                    to,
                    worker: w,
                    unit,
                    settled,
                }));
            }
            return true;
        }
        if self.gate.consistency() != Consistency::Asp {
            let Some(&(unit, settled)) = self.grants.get(&w) else {
                return false;
            };
            if unit != NO_MORE_WORK && self.outstanding.range(..settled).next().is_some() {
                return false;
            }
            self.grants.remove(&w);
            if unit != NO_MORE_WORK {
                self.outstanding.insert(unit, w);
            }
        }
        replies.push(Reply::Params {
            worker: w,
            clock,
            unit: 0,
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(worker: usize, clock: u64, unit: u64) -> Reply {
        Reply::Params {
            worker,
            clock,
            unit,
        }
    }

    fn grant(worker: usize, unit: u64, settled: u64) -> Reply {
        Reply::Grant {
            to: 1,
            worker,
            unit,
            settled,
        }
    }

    /// Server 0 under SSP(1) with 2 workers (2 units per iteration) and 2 servers: units go out
    /// in order, each answer grants server 1, and a worker two iterations ahead of the oldest
    /// unit in progress waits until it is pushed.
    #[test]
    fn server_zero_assigns_units_in_order_and_grants_the_other_servers() {
        let mut a = Admission::new(Consistency::Ssp { staleness: 1 }, 0, 2, 2, 0..8);
        assert_eq!(a.pull(0, 0, 0.0), vec![params(0, 0, 0), grant(0, 0, 0)]);
        assert_eq!(a.pull(1, 0, 0.0), vec![params(1, 0, 1), grant(1, 1, 0)]);
        // Worker 1 is fast: unit 1 pushed, unit 2 (iteration 1) is one ahead of unit 0: allowed.
        assert_eq!(a.pushed(1, 1, 1.0), vec![]);
        assert_eq!(a.pull(1, 1, 1.0), vec![params(1, 1, 2), grant(1, 2, 0)]);
        assert_eq!(a.pushed(1, 2, 2.0), vec![]);
        assert_eq!(a.pull(1, 2, 2.0), vec![params(1, 2, 3), grant(1, 3, 0)]);
        assert_eq!(a.pushed(1, 3, 3.0), vec![]);
        // Unit 4 is iteration 2, two ahead of unit 0 (iteration 0): park.
        assert_eq!(a.pull(1, 3, 3.0), vec![]);
        assert_eq!(a.parked_count(), 1);
        // Worker 0 pushes unit 0: the parked pull goes; units 0..4 are now settled.
        assert_eq!(a.pushed(0, 0, 4.0), vec![params(1, 3, 4), grant(1, 4, 4)]);
        // Worker 0 comes back and gets the next unit, behind worker 1's.
        assert_eq!(a.pull(0, 1, 4.0), vec![params(0, 1, 5), grant(0, 5, 4)]);
        assert_eq!(a.gate().staleness_histogram(), &[4, 2]);
    }

    #[test]
    fn server_zero_says_no_more_work_at_the_end_without_asking_the_gate() {
        let mut a = Admission::new(Consistency::Ssp { staleness: 0 }, 0, 1, 2, 0..2);
        assert_eq!(a.pull(0, 0, 0.0), vec![params(0, 0, 0)]);
        assert_eq!(a.pull(1, 0, 0.0), vec![params(1, 0, 1)]);
        assert_eq!(a.pushed(0, 0, 1.0), vec![]);
        // Worker 1 still computes unit 1, but there is no unit left to wait for.
        assert_eq!(a.pull(0, 1, 1.0), vec![params(0, 1, NO_MORE_WORK)]);
    }

    /// Another server answers only with server 0's grant, and only once every unit below the
    /// grant's settled mark has been pushed to it.
    #[test]
    fn other_server_waits_for_the_grant_and_for_pushes_still_on_their_way() {
        let mut a = Admission::new(Consistency::Dssp { lower: 1, upper: 4 }, 1, 2, 2, 0..8);
        // The pull arrives before its grant.
        assert_eq!(a.pull(0, 0, 0.0), vec![]);
        assert_eq!(a.grant(0, 0, 0, 0.0), vec![params(0, 0, 0)]);
        assert_eq!(a.grant(1, 1, 0, 0.0), vec![]);
        assert_eq!(a.pull(1, 0, 0.0), vec![params(1, 0, 0)]);
        // Server 0 saw unit 0 pushed and grants worker 0 unit 2 with settled 1; the push of unit 0
        // to this server is still on its way, so the pull waits for it.
        assert_eq!(a.grant(0, 2, 1, 1.0), vec![]);
        assert_eq!(a.pull(0, 1, 1.0), vec![]);
        assert_eq!(a.pushed(0, 0, 1.5), vec![params(0, 1, 0)]);
        // Unit 1 (worker 1) is below no settled mark yet: worker 0 is not held back by it.
        assert_eq!(a.grant(0, 3, 1, 2.0), vec![]);
        assert_eq!(a.pushed(0, 2, 2.0), vec![]);
        assert_eq!(a.pull(0, 2, 2.0), vec![params(0, 2, 0)]);
    }

    #[test]
    fn other_server_releases_a_dead_workers_unit() {
        let mut a = Admission::new(Consistency::Ssp { staleness: 2 }, 1, 2, 2, 0..8);
        assert_eq!(a.grant(1, 1, 0, 0.0), vec![]);
        assert_eq!(a.pull(1, 0, 0.0), vec![params(1, 0, 0)]);
        // Server 0 dropped worker 1 (unit 1 abandoned) and grants worker 0 with settled 2.
        assert_eq!(a.grant(0, 2, 2, 1.0), vec![]);
        assert_eq!(a.pull(0, 0, 1.0), vec![]);
        // This server's own heartbeat timeout drops worker 1 too: the pull goes.
        assert_eq!(a.drop_worker(1, 5.0), vec![params(0, 0, 0)]);
    }

    #[test]
    fn no_more_work_is_answered_at_once_on_every_server() {
        let mut a = Admission::new(Consistency::Ssp { staleness: 0 }, 1, 2, 2, 0..8);
        assert_eq!(a.grant(1, 1, 0, 0.0), vec![]);
        assert_eq!(a.pull(1, 0, 0.0), vec![params(1, 0, 0)]);
        assert_eq!(a.grant(0, NO_MORE_WORK, 9, 1.0), vec![]);
        assert_eq!(a.pull(0, 4, 1.0), vec![params(0, 4, 0)]);
    }

    #[test]
    fn asp_never_parks_and_sends_no_grants() {
        for s in 0..2 {
            let mut a = Admission::new(Consistency::Asp, s, 2, 2, 0..100);
            for clock in 0..20 {
                let replies = a.pull(0, clock, clock as f64);
                assert_eq!(replies.len(), 1, "server {s}: {replies:?}");
                a.pushed(0, clock, clock as f64 + 0.5);
            }
            assert_eq!(a.parked_count(), 0);
        }
    }

    /// BSP: every server gates the same way on push counts; units are fixed.
    #[test]
    fn bsp_servers_agree_and_units_are_fixed() {
        for s in 0..2 {
            let mut a = Admission::new(Consistency::Bsp, s, 2, 2, 4..8);
            let unit = |u: u64| if s == 0 { u } else { 0 };
            assert_eq!(a.pull(1, 0, 0.0), vec![params(1, 0, unit(5))]);
            assert_eq!(a.pushed(1, 5, 1.0), vec![]);
            assert_eq!(a.pull(1, 1, 1.0), vec![]);
            assert_eq!(a.pull(0, 0, 1.0), vec![params(0, 0, unit(4))]);
            assert_eq!(a.pushed(0, 4, 2.0), vec![params(1, 1, unit(7))]);
            assert_eq!(a.pull(0, 1, 2.0), vec![params(0, 1, unit(6))]);
            a.pushed(0, 6, 3.0);
            a.pushed(1, 7, 3.0);
            let end = if s == 0 { NO_MORE_WORK } else { 0 };
            assert_eq!(a.pull(0, 2, 3.0), vec![params(0, 2, end)]);
        }
    }
}
