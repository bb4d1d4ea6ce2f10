//! What the heal decides, apart from the messages that carry it: the master's choice when a
//! member dies (who takes its layers, from which replication round the ring goes on, which step
//! the failure interrupted), and each survivor's (which state it restores, which members left).
//! Pure functions, table-tested from `tests/data/heal/` (`tests/protocols.rs`).

use std::fmt;

/// The master's decision to heal around a dead member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heal {
    /// The member that died.
    pub dead: u32,
    /// Its predecessor in the ring, which takes its layers over from its replica.
    pub pred: u32,
    /// The ring without it, in ring order.
    pub survivors: Vec<u32>,
    /// The replication round every survivor goes back to (the last complete one).
    pub step: u64,
    /// The mini-batch the failure interrupted (at least the round's): the steps from `step` to
    /// here are trained again.
    pub failed_at: u64,
}

impl fmt::Display for Heal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "heal dead={} pred={} survivors={:?} step={} failed_at={} redone={}",
            self.dead,
            self.pred,
            self.survivors,
            self.step,
            self.failed_at,
            self.failed_at - self.step
        )
    }
}

/// Why the ring cannot heal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The master itself: it holds the data.
    Master,
    /// Not a member of this ring.
    NotMember(u32),
    /// No replication round completed since the ring last formed, so the replicas a heal needs
    /// may be missing or half written.
    NoCompleteRound,
    /// Rings of rings: the copies of the ring's stages in the other rings synchronised at
    /// mini-batch `sync` after the round, or may be doing so now, with the dead node's part;
    /// the ring cannot go back past it.
    PastSynchronisation {
        /// The last complete round.
        round: u64,
        /// The synchronisation after it.
        sync: u64,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Master => write!(f, "the master cannot be healed around"),
            Self::NotMember(r) => write!(f, "rank {r} is not in the ring"),
            Self::NoCompleteRound => write!(
                f,
                "no replication round had completed since the ring last formed, so it cannot \
                 heal"
            ),
            Self::PastSynchronisation { round, sync } => write!(
                f,
                "the copies of its stages in the other rings synchronised after mini-batch \
                 {sync} (or were doing so), later than the last complete replication round \
                 ({round}), so the ring cannot go back to that round"
            ),
        }
    }
}

/// The master's decision when `dead` died, for the ring of `members` (physical ranks in ring
/// order, the master first), whose last complete replication round is `round` and whose last
/// completed mini-batch is `last_step`.
pub fn decide(
    members: &[u32],
    dead: u32,
    round: Option<u64>,
    last_step: u64,
) -> Result<Heal, Refusal> {
    let index = members
        .iter()
        .position(|m| *m == dead)
        .ok_or(Refusal::NotMember(dead))?;
    if index == 0 {
        return Err(Refusal::Master);
    }
    let step = round.ok_or(Refusal::NoCompleteRound)?;
    Ok(Heal {
        dead,
        pred: members[index - 1],
        survivors: members.iter().copied().filter(|m| *m != dead).collect(),
        step,
        failed_at: last_step.max(step),
    })
}

/// Rings of rings that synchronise every `every` mini-batches and after the last (`total`):
/// whether a ring may go back to replication round `round` when a failure found it having
/// completed `last_step` mini-batches. It may not when a synchronisation falls after the round
/// and no later than the end of the mini-batch in progress (the dead node may have taken part
/// in it: the other rings' copies would not take it again).
pub fn check_synchronisation(
    round: u64,
    last_step: u64,
    every: u64,
    total: u64,
) -> Result<(), Refusal> {
    if every == 0 {
        return Ok(());
    }
    let sync = ((round / every + 1) * every).min(total);
    if sync <= last_step + 1 {
        return Err(Refusal::PastSynchronisation { round, sync });
    }
    Ok(())
}

/// What a survivor restores its stage from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restore {
    /// Its own snapshot of the round.
    Own,
    /// Its own snapshot joined with its successor's replica: its successor left, and its layers
    /// are this node's now.
    OwnAndSuccessor,
}

/// What `rank` of the ring `before` restores when the ring becomes `after`.
pub fn restore(rank: u32, before: &[u32], after: &[u32]) -> Restore {
    let successor = before
        .iter()
        .position(|m| *m == rank)
        .and_then(|i| before.get(i + 1));
    match successor {
        Some(s) if !after.contains(s) => Restore::OwnAndSuccessor,
        _ => Restore::Own,
    }
}

/// The members of `before` that `after` leaves out, in ring order.
pub fn departed(before: &[u32], after: &[u32]) -> Vec<u32> {
    before
        .iter()
        .copied()
        .filter(|m| !after.contains(m))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_of_rings_goes_back_no_further_than_the_last_synchronisation() {
        // Rounds and synchronisations every 4 of 12 mini-batches; the round of 4 is complete.
        for last_step in 4..=6 {
            assert_eq!(check_synchronisation(4, last_step, 4, 12), Ok(()));
        }
        // Mini-batch 8's synchronisation is under way, or done.
        for last_step in 7..=9 {
            assert_eq!(
                check_synchronisation(4, last_step, 4, 12),
                Err(Refusal::PastSynchronisation { round: 4, sync: 8 })
            );
        }
        // The run's end synchronises too.
        assert_eq!(
            check_synchronisation(8, 9, 4, 10),
            Err(Refusal::PastSynchronisation { round: 8, sync: 10 })
        );
        assert_eq!(check_synchronisation(8, 8, 4, 10), Ok(()));
        // Rings that never synchronise (gossip) have nothing to go back past.
        assert_eq!(check_synchronisation(0, 100, 0, 200), Ok(()));
    }
}
