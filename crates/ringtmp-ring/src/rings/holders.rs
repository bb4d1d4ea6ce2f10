//! Which node of every ring holds each stage's layers, as rings heal (`--replicas` with
//! `--stage-replicas`), and the tags of the stage groups' all-reduce that follow from it.
//!
//! A ring starts with node `s` holding stage `s`. When a node dies, its predecessor in the ring
//! takes its layers over (`crate::heal`), so in a ring whose surviving nodes are `members`
//! (their starting ranks, ascending), stage `u` is held by the last member at or before `u`, and
//! a member holds the stages from its own up to the next member's. The copies of stage `u` — its
//! *group* — are those holders, one per ring, in ring order.
//!
//! Every ring's heals are numbered (its generation), and its master announces each one to the
//! other rings, so the copies of a stage may for a while disagree on its group. A group
//! all-reduce's tensors carry a digest of the group they were sent under: a copy that learns
//! that its stage's group changed starts its all-reduce again under the new one (a group
//! changes only when a holder died, so nobody completed under the old one), and what was sent
//! under the old group is dropped. A heal elsewhere leaves a stage's group, and its all-reduce,
//! alone.

use std::ops::Range;

/// `micro_batch` of the group all-reduce's tensors: this marker at bits 32–43, the group's
/// digest from bit 44, the stage at bits 20–31, the phase (0 reduce-scatter, 1 all-gather) at
/// bit 16 and the round below.
pub(crate) const GROUP: u64 = 0xA11_0000_0000;
const MARKER_MASK: u64 = 0xFFF_0000_0000;

/// The tag of round `round` of `phase` of stage `unit`'s all-reduce among `group`.
pub(crate) fn group_tag(group: &[u32], unit: u32, phase: u64, round: usize) -> u64 {
    GROUP
        | digest(group) << 44
        | u64::from(unit & 0xFFF) << 20
        | (phase & 1) << 16
        | round as u64 & 0xFFFF
}

/// Whether `tag` belongs to stage `unit`'s all-reduce among `group`.
pub(crate) fn tag_of_group(tag: u64, group: &[u32], unit: u32) -> bool {
    tag & MARKER_MASK == GROUP
        && tag >> 44 == digest(group)
        && (tag >> 20) & 0xFFF == u64::from(unit & 0xFFF)
}

/// 20 bits of FNV-1a over the group's ranks.
fn digest(group: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in group {
        for b in r.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    (h ^ h >> 20 ^ h >> 40) & 0xF_FFFF
}

/// The holders of every stage in every ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holders {
    /// Per ring: its surviving nodes' starting ranks, ascending (ring order).
    members: Vec<Vec<u32>>,
    /// Per ring: how many times it re-formed.
    generations: Vec<u64>,
    stages: u32,
}

impl Holders {
    /// `rings` whole rings of `stages` nodes.
    pub fn new(rings: u32, stages: u32) -> Self {
        Self {
            members: vec![(0..stages).collect(); rings as usize],
            generations: vec![0; rings as usize],
            stages,
        }
    }

    /// The node (starting rank in its ring) of ring `ring` that holds stage `unit`.
    pub fn holder(&self, ring: u32, unit: u32) -> u32 {
        self.members[ring as usize]
            .iter()
            .copied()
            .filter(|m| *m <= unit)
            .max()
            .unwrap_or(0)
    }

    /// The stages node `node` of ring `ring` holds (empty when it left).
    pub fn units(&self, ring: u32, node: u32) -> Range<u32> {
        let members = &self.members[ring as usize];
        if !members.contains(&node) {
            return node..node;
        }
        let next = members
            .iter()
            .copied()
            .filter(|m| *m > node)
            .min()
            .unwrap_or(self.stages);
        node..next
    }

    /// Whether node `node` of ring `ring` is still in it.
    pub fn is_member(&self, ring: u32, node: u32) -> bool {
        self.members[ring as usize].contains(&node)
    }

    /// The copies of stage `unit`: its holder in each ring, as physical ranks, ring order.
    pub fn group(&self, unit: u32) -> Vec<u32> {
        (0..self.members.len() as u32)
            .map(|r| r * self.stages + self.holder(r, unit))
            .collect()
    }

    /// Ring `ring` re-formed in `generation` as `members`; whether that was news (a stale or
    /// repeated announcement changes nothing).
    pub fn regrouped(&mut self, ring: u32, generation: u64, members: &[u32]) -> bool {
        let Some(current) = self.generations.get_mut(ring as usize) else {
            return false;
        };
        if generation <= *current {
            return false;
        }
        *current = generation;
        let mut members: Vec<u32> = members
            .iter()
            .copied()
            .filter(|m| *m < self.stages)
            .collect();
        members.sort_unstable();
        members.dedup();
        self.members[ring as usize] = members;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_nodes_stages_go_to_its_predecessor_in_its_ring_only() {
        let mut h = Holders::new(3, 4);
        assert_eq!(h.group(2), vec![2, 6, 10]);
        assert_eq!(h.units(1, 1), 1..2);
        assert!(h.regrouped(1, 1, &[0, 1, 3]));
        assert_eq!(h.group(2), vec![2, 5, 10]);
        assert_eq!(h.group(3), vec![3, 7, 11]);
        assert_eq!(h.units(1, 1), 1..3);
        assert_eq!(h.units(1, 2), 2..2);
        assert!(!h.is_member(1, 2) && h.is_member(1, 3) && h.is_member(0, 2));
        // Two neighbours gone: the survivor before them holds all three.
        assert!(h.regrouped(1, 2, &[0, 3]));
        assert_eq!(h.units(1, 0), 0..3);
        assert_eq!(h.group(1), vec![1, 4, 9]);
        // A late or repeated announcement changes nothing.
        assert!(!h.regrouped(1, 1, &[0, 1, 3]));
        assert_eq!(h.units(1, 0), 0..3);
        assert!(h.regrouped(2, 1, &[0, 1, 2]));
        assert_eq!(h.units(2, 2), 2..4);
        assert_eq!(h.group(0), vec![0, 4, 8]);
    }

    #[test]
    fn tags_keep_their_fields_apart() {
        let (g, other) = ([2, 6, 10], [2, 5, 10]);
        let a = group_tag(&g, 7, 1, 2);
        assert!(tag_of_group(a, &g, 7));
        assert!(!tag_of_group(a, &other, 7));
        assert!(!tag_of_group(a, &g, 6));
        assert_ne!(a, group_tag(&g, 7, 0, 2));
        assert_ne!(a, group_tag(&g, 7, 1, 1));
        assert_ne!(a, group_tag(&g, 6, 1, 2));
        assert_ne!(a, group_tag(&other, 7, 1, 2));
        assert!(!tag_of_group(super::super::gossip::REQUEST, &g, 7));
        assert!(!tag_of_group(crate::heal::replicas::REPLICA, &g, 7));
        // The groups a heal makes of one another differ in their digests.
        let mut seen = std::collections::BTreeSet::new();
        for dead in 0..64u32 {
            for ring in 0..8u32 {
                let group: Vec<u32> = (0..8u32)
                    .map(|r| r * 64 + if r == ring { dead / 2 } else { dead })
                    .collect();
                seen.insert(digest(&group));
            }
        }
        assert!(seen.len() > 500, "{} digests of 512 groups", seen.len());
    }
}
