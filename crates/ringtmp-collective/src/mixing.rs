//! Who gossips with whom, and with which weights: the communication graphs of the decentralised
//! strategies and their mixing matrices, as pure functions.
//!
//! - `ring`: each worker's neighbours are its predecessor and successor.
//! - `exp`: also the workers 2^i hops away in both directions, i = 0 … ⌊log2(N − 1)⌋ (the
//!   exponential graph of SGP and the AD-PSGD paper's experiments).
//!
//! Both are circulant graphs, so every worker has the same degree d, and the uniform weights
//! 1/(d + 1) (self included) make the mixing matrix W symmetric and doubly stochastic: averaging
//! keeps the sum of the models, and with a connected graph every model converges to their mean
//! at the rate of W's second-largest eigenvalue modulus, which for a circulant W is
//! λ_k = (1 + Σ_{s ∈ offsets} cos(2πks/N)) / (d + 1), k = 1 … N − 1 (Lian et al., NeurIPS 2017).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

/// A decentralised communication graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Topology {
    /// Predecessor and successor.
    #[default]
    Ring,
    /// The ring plus links 2^i hops away.
    Exp,
}

/// The hop distances (positive, at most N/2) a worker of `n` links to.
pub fn offsets(topology: Topology, n: u32) -> BTreeSet<u32> {
    if n < 2 {
        return BTreeSet::new();
    }
    let hops: Vec<u32> = match topology {
        Topology::Ring => vec![1],
        Topology::Exp => (0..).map(|i| 1u32 << i).take_while(|h| *h < n).collect(),
    };
    // A hop h and its opposite n − h reach the same workers: keep the shorter.
    hops.into_iter().map(|h| h.min(n - h)).collect()
}

/// The neighbours of `rank` among `n` workers.
pub fn neighbours(topology: Topology, rank: u32, n: u32) -> BTreeSet<u32> {
    offsets(topology, n)
        .into_iter()
        .flat_map(|h| [(rank + h) % n, (rank + n - h) % n])
        .filter(|p| *p != rank)
        .collect()
}

/// AD-PSGD's hop distances among `n` workers (Lian et al., ICML 2018): the ring (1 hop) and the
/// links 2^i + 1 hops away, i ≥ 1 (3, 5, 9, 17, …; i = 0 would be 2 hops, which joins two
/// workers of the same parity). Every hop is odd, so on an even number of workers each link joins
/// an even rank to an odd one: the graph is bipartite, even ranks active, odd ranks passive.
pub fn bipartite_offsets(n: u32) -> BTreeSet<u32> {
    if n < 2 {
        return BTreeSet::new();
    }
    std::iter::once(1)
        .chain((1..).map(|i| (1u32 << i) + 1).take_while(|h| *h < n))
        .map(|h| h.min(n - h))
        .collect()
}

/// The neighbours of `rank` among `n` workers in AD-PSGD's graph.
pub fn bipartite_neighbours(rank: u32, n: u32) -> BTreeSet<u32> {
    bipartite_offsets(n)
        .into_iter()
        .flat_map(|h| [(rank + h) % n, (rank + n - h) % n])
        .filter(|p| *p != rank)
        .collect()
}

/// A 2-colouring of the graph on `n` vertices that `neighbours` describes, with vertex 0 coloured
/// `false`, found by breadth-first search: `None` when the graph is not bipartite (it has an odd
/// cycle) or not connected. In AD-PSGD `false` is active, `true` passive.
pub fn two_colouring(n: u32, neighbours: impl Fn(u32) -> BTreeSet<u32>) -> Option<Vec<bool>> {
    let mut colour: Vec<Option<bool>> = vec![None; n as usize];
    let mut queue = std::collections::VecDeque::from([0u32]);
    colour.first_mut().map(|c| *c = Some(false))?;
    while let Some(v) = queue.pop_front() {
        let c = colour[v as usize]?;
        for w in neighbours(v) {
            match colour[w as usize] {
                Some(same) if same == c => return None,
                Some(_) => {}
                None => {
                    colour[w as usize] = Some(!c);
                    queue.push_back(w);
                }
            }
        }
    }
    colour.into_iter().collect()
}

/// The mixing matrix W (row-major, n × n): 1/(d + 1) for a worker and each of its neighbours.
pub fn matrix(topology: Topology, n: u32) -> Vec<Vec<f64>> {
    (0..n)
        .map(|r| {
            let near = neighbours(topology, r, n);
            let w = 1.0 / (near.len() + 1) as f64;
            (0..n)
                .map(|c| if c == r || near.contains(&c) { w } else { 0.0 })
                .collect()
        })
        .collect()
}

/// The second-largest eigenvalue modulus of W: how fast gossip alone brings the models together
/// (the distance to their mean shrinks by about this factor per round).
pub fn second_eigenvalue(topology: Topology, n: u32) -> f64 {
    if n < 2 {
        return 0.0;
    }
    let near = neighbours(topology, 0, n);
    let d = near.len() as f64;
    (1..n)
        .map(|k| {
            let sum: f64 = near
                .iter()
                .map(|&p| {
                    (2.0 * std::f64::consts::PI * f64::from(k) * f64::from(p) / f64::from(n)).cos()
                })
                .sum();
            ((1.0 + sum) / (d + 1.0)).abs()
        })
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adpsgd_graph_is_bipartite_on_even_counts_only() {
        assert_eq!(bipartite_neighbours(0, 8), BTreeSet::from([1, 3, 5, 7]));
        assert_eq!(
            bipartite_neighbours(0, 16),
            BTreeSet::from([1, 3, 5, 7, 9, 11, 13, 15])
        );
        assert_eq!(
            bipartite_neighbours(0, 12),
            BTreeSet::from([1, 3, 5, 7, 9, 11])
        );
        assert_eq!(bipartite_neighbours(1, 2), BTreeSet::from([0]));
        for n in 2..40u32 {
            let colours = two_colouring(n, |r| bipartite_neighbours(r, n));
            if n % 2 == 0 {
                let colours = colours.expect("even counts are bipartite and connected");
                for r in 0..n {
                    assert_eq!(colours[r as usize], r % 2 == 1, "odd ranks passive");
                    for p in bipartite_neighbours(r, n) {
                        assert_ne!(colours[r as usize], colours[p as usize]);
                        assert!(bipartite_neighbours(p, n).contains(&r), "symmetric");
                    }
                }
            } else {
                assert!(colours.is_none(), "{n} workers: the ring is an odd cycle");
            }
        }
        // A graph in two pieces has no colouring that covers it.
        assert!(two_colouring(4, |r| BTreeSet::from([r ^ 1])).is_none());
    }

    #[test]
    fn the_mixing_matrix_is_symmetric_and_doubly_stochastic_on_a_regular_graph() {
        // Ref: Lian et al. 2017, assumption on W (symmetric, doubly stochastic).
        for topology in [Topology::Ring, Topology::Exp] {
            for n in 2..20 {
                let w = matrix(topology, n);
                let degree = neighbours(topology, 0, n).len();
                for r in 0..n as usize {
                    assert_eq!(neighbours(topology, r as u32, n).len(), degree, "regular");
                    let row: f64 = w[r].iter().sum();
                    let col: f64 = w.iter().map(|row| row[r]).sum();
                    assert!((row - 1.0).abs() < 1e-12 && (col - 1.0).abs() < 1e-12);
                    for (c, row) in w.iter().enumerate() {
                        assert_eq!(w[r][c], row[r]);
                    }
                }
            }
        }
    }

    #[test]
    fn topologies_have_the_expected_links() {
        assert_eq!(neighbours(Topology::Ring, 0, 8), BTreeSet::from([1, 7]));
        assert_eq!(
            neighbours(Topology::Exp, 0, 8),
            BTreeSet::from([1, 2, 4, 6, 7])
        );
        assert_eq!(
            neighbours(Topology::Exp, 3, 5),
            BTreeSet::from([1, 2, 4, 0])
        );
        assert_eq!(neighbours(Topology::Ring, 1, 2), BTreeSet::from([0]));
        // The exponential graph mixes faster than the ring.
        assert!(second_eigenvalue(Topology::Exp, 16) < second_eigenvalue(Topology::Ring, 16));
        // The ring's: (1 + 2 cos(2π/n)) / 3.
        let ring8 = (1.0 + 2.0 * (2.0 * std::f64::consts::PI / 8.0).cos()) / 3.0;
        assert!((second_eigenvalue(Topology::Ring, 8) - ring8).abs() < 1e-12);
    }

    #[test]
    fn averaging_keeps_the_sum_and_contracts_at_the_second_eigenvalue() {
        for (topology, n) in [(Topology::Ring, 8), (Topology::Exp, 8), (Topology::Ring, 5)] {
            let w = matrix(topology, n);
            let mut x: Vec<f64> = (0..n).map(|i| f64::from(i * i) - 3.0).collect();
            let sum: f64 = x.iter().sum();
            let mean = sum / f64::from(n);
            let dist = |x: &[f64]| x.iter().map(|v| (v - mean).powi(2)).sum::<f64>().sqrt();
            let lambda = second_eigenvalue(topology, n);
            for _ in 0..10 {
                let before = dist(&x);
                x = (0..n as usize)
                    .map(|r| (0..n as usize).map(|c| w[r][c] * x[c]).sum())
                    .collect();
                assert!(
                    (x.iter().sum::<f64>() - sum).abs() < 1e-9,
                    "the sum is conserved"
                );
                assert!(
                    dist(&x) <= lambda * before + 1e-9,
                    "{} > {lambda} × {before}",
                    dist(&x)
                );
            }
        }
    }
}
