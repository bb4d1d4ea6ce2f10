//! When a DiLoCo worker's rounds launch, land and start again: the rules of a round's life over
//! step counts, as a machine without links or parameters, so each rule is a case in a table.
//!
//! Rules: after `done` steps the fragments the schedule names are due; the worker contributes
//! to their round only if it trained every one of them since their last synchronisation (a
//! worker that rejoined or took rank 0's state sends zeros of weight 0); a round is overlapped
//! — in flight for τ inner steps — unless τ is 0 or its landing would fall at or past the run's
//! end (the run ends with every round landed); a round in flight lands before the next one
//! launches. After a broken reduction the same round goes again on the re-formed ring, unless
//! rank 0's outer state replaced this worker's: then it joins the round rank 0 redoes (the one
//! after the updates it took), contributing nothing, landing at once.

use ringtmp_collective::outer::SyncSchedule;
use ringtmp_contract::error::{Error, Result};

/// A round to launch now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Launch {
    /// The step count it is taken at.
    pub(crate) done: u64,
    /// Its fragments.
    pub(crate) due: Vec<usize>,
    /// Whether this worker's pseudo-gradients count (weight 1) or it sends zeros (weight 0).
    pub(crate) contributes: bool,
    /// `Some(at)`: in flight until `at` steps are done; `None`: it lands at once.
    pub(crate) lands_at: Option<u64>,
}

/// One worker's rounds over the run.
pub(crate) struct Cadence {
    schedule: SyncSchedule,
    /// τ: inner steps a round stays in flight (0: every round blocks).
    overlap: u64,
    /// The step count the run started from (0, or a checkpoint's).
    first: u64,
    /// Inner steps trained since each fragment's last synchronisation.
    trained: Vec<u64>,
}

impl Cadence {
    pub(crate) fn new(schedule: SyncSchedule, overlap: u64, first: u64) -> Self {
        Self {
            trained: vec![0; schedule.f],
            schedule,
            overlap,
            first,
        }
    }

    /// The schedule the rounds follow.
    pub(crate) fn schedule(&self) -> &SyncSchedule {
        &self.schedule
    }

    /// One inner step trained every fragment one step further.
    pub(crate) fn stepped(&mut self) {
        self.trained.iter_mut().for_each(|t| *t += 1);
    }

    /// Whether a round in flight until `lands_at` lands after `done` steps.
    pub(crate) fn lands(&self, lands_at: u64, done: u64) -> bool {
        lands_at <= done
    }

    /// The round due after `done` steps, if any (its fragments then count from zero again).
    pub(crate) fn launch(&mut self, done: u64) -> Option<Launch> {
        let due = self.schedule.due(done);
        if due.is_empty() {
            return None;
        }
        let contributes = due.iter().all(|p| self.trained[*p] > 0);
        for p in &due {
            self.trained[*p] = 0;
        }
        let overlapped = self.overlap > 0 && done + self.overlap < self.schedule.total;
        Some(Launch {
            done,
            due,
            contributes,
            lands_at: overlapped.then_some(done + self.overlap),
        })
    }

    /// Rank 0's outer state, after `updates` outer steps, replaced this worker's: its own
    /// progress is void, and the round it joins is the one rank 0 redoes.
    pub(crate) fn redo(&mut self, updates: u64) -> Result<Launch> {
        self.trained.iter_mut().for_each(|t| *t = 0);
        let done = self.schedule.nth(self.first, updates).ok_or_else(|| {
            Error::Config(format!(
                "diloco: rank 0's outer state has {updates} updates, past the run's last \
                 synchronisation"
            ))
        })?;
        Ok(Launch {
            done,
            due: self.schedule.due(done),
            contributes: false,
            lands_at: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cadence(h: u64, f: usize, total: u64, overlap: u64) -> Cadence {
        Cadence::new(SyncSchedule { h, f, total }, overlap, 0)
    }

    /// Steps `c` through `steps`, launching what is due; per step count, its round (if any).
    fn rounds(c: &mut Cadence, steps: u64) -> Vec<(u64, Vec<usize>, bool, Option<u64>)> {
        let mut seen = Vec::new();
        for done in 1..=steps {
            c.stepped();
            if let Some(l) = c.launch(done) {
                seen.push((l.done, l.due, l.contributes, l.lands_at));
            }
        }
        seen
    }

    #[test]
    fn blocking_rounds_every_h_steps_and_at_the_end() {
        let mut c = cadence(4, 1, 10, 0);
        assert_eq!(
            rounds(&mut c, 10),
            vec![
                (4, vec![0], true, None),
                (8, vec![0], true, None),
                (10, vec![0], true, None),
            ]
        );
    }

    #[test]
    fn overlapped_rounds_land_tau_steps_later_but_never_past_the_end() {
        let mut c = cadence(4, 1, 10, 2);
        assert_eq!(
            rounds(&mut c, 10),
            vec![
                (4, vec![0], true, Some(6)),
                // 8 + 2 reaches the end: this one blocks.
                (8, vec![0], true, None),
                (10, vec![0], true, None),
            ]
        );
        assert!(!c.lands(6, 5) && c.lands(6, 6) && c.lands(6, 7));
    }

    #[test]
    fn fragments_take_turns_and_all_synchronise_at_the_end() {
        let mut c = cadence(4, 2, 9, 0);
        assert_eq!(
            rounds(&mut c, 9),
            vec![
                (2, vec![0], true, None),
                (4, vec![1], true, None),
                (6, vec![0], true, None),
                (8, vec![1], true, None),
                (9, vec![0, 1], true, None),
            ]
        );
    }

    #[test]
    fn a_worker_that_did_not_train_a_fragment_since_its_last_round_contributes_nothing() {
        let mut c = cadence(2, 1, 6, 0);
        c.stepped();
        c.stepped();
        assert!(c.launch(2).is_some_and(|l| l.contributes));
        // Rejoined at step 4 without training since step 2.
        assert_eq!(
            c.launch(4),
            Some(Launch {
                done: 4,
                due: vec![0],
                contributes: false,
                lands_at: None
            })
        );
        assert_eq!(c.launch(3), None);
    }

    #[test]
    fn a_worker_replaced_by_rank_zeros_state_joins_the_round_rank_zero_redoes() {
        let mut c = Cadence::new(
            SyncSchedule {
                h: 3,
                f: 1,
                total: 12,
            },
            1,
            3,
        );
        c.stepped();
        // Started after 3 steps; rank 0 has taken 2 outer updates (at 6 and 9): it redoes 12.
        assert_eq!(
            c.redo(2).expect("within the run"),
            Launch {
                done: 12,
                due: vec![0],
                contributes: false,
                lands_at: None
            }
        );
        assert_eq!(c.redo(0).map(|l| l.done).ok(), Some(6));
        let past = c.redo(3).expect_err("past the last synchronisation");
        assert!(past.to_string().contains("3 updates"), "{past}");
    }
}
