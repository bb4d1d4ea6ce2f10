//! Partitioning a model's layers into contiguous stages, one per ring node.
//!
//! The planner takes each layer's measured forward+backward time on one micro-batch and its memory
//! (parameters, optimizer state, stashed activations for the in-flight micro-batches), each node's
//! relative speed and memory limit, and finds by dynamic programming the contiguous split that
//! minimises the slowest stage's time, `max_s Σ t_l / speed_s`, subject to every node's memory
//! limit. Stage 0 always contains the model's first layer with parameters, so what leaves the
//! master is never the raw input (a flatten alone would send the pixels).

use serde::{Deserialize, Serialize};

/// Cost of one layer as measured or computed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Seconds for forward + backward of one micro-batch.
    pub seconds: f64,
    /// Bytes the layer costs its node: parameters, gradients, optimizer state and stashed
    /// activations for the in-flight micro-batches.
    pub bytes: u64,
}

/// A node's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeCapacity {
    /// Relative speed in (0, 1]; a node at 0.5 takes twice as long for the same work.
    pub speed: f64,
    /// Most bytes the node may hold (`None` = unlimited).
    pub memory_limit: Option<u64>,
}

/// One stage of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    /// Node (rank) that runs it.
    pub rank: u32,
    /// First layer (inclusive).
    pub start: usize,
    /// Last layer (exclusive).
    pub end: usize,
    /// Predicted seconds per micro-batch on that node (forward, backward and its share of the
    /// optimizer step).
    pub predicted_seconds: f64,
    /// Predicted bytes on that node.
    pub predicted_bytes: u64,
}

/// Why no plan exists.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// More nodes than layers: some stage would be empty.
    #[error(
        "{nodes} nodes but only {layers} layers to place (the first node's block runs up to the \
         first layer with parameters): every node needs at least one layer"
    )]
    TooManyNodes {
        /// Nodes.
        nodes: usize,
        /// Layers.
        layers: usize,
    },
    /// The memory limits cannot be met.
    #[error(
        "no partition fits the nodes' memory limits (the model needs {needed} bytes in total; limits: {limits})"
    )]
    DoesNotFit {
        /// Total bytes of all layers.
        needed: u64,
        /// The limits, for the message.
        limits: String,
    },
    /// A user-given partition is invalid.
    #[error("invalid --partition {given:?}: {reason}")]
    Invalid {
        /// What was given.
        given: String,
        /// Why it is invalid.
        reason: String,
    },
}

/// Finds the plan minimising the slowest stage. `first_param_layer` must fall into stage 0.
pub fn plan(
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
) -> Result<Vec<StagePlan>, PlanError> {
    let (l, n) = (costs.len(), nodes.len());
    // Stage 0 holds every layer up to the first with parameters: the others count as one.
    let blocks = l - first_param_layer.min(l.saturating_sub(1));
    if n > blocks {
        return Err(PlanError::TooManyNodes {
            nodes: n,
            layers: blocks,
        });
    }
    let prefix_t: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |a, c| {
            *a += c.seconds;
            Some(*a)
        }))
        .collect();
    let prefix_b: Vec<u64> = std::iter::once(0)
        .chain(costs.iter().scan(0, |a, c| {
            *a += c.bytes;
            Some(*a)
        }))
        .collect();
    let stage_cost = |s: usize, i: usize, j: usize| -> Option<f64> {
        let bytes = prefix_b[j] - prefix_b[i];
        if nodes[s].memory_limit.is_some_and(|m| bytes > m) {
            return None;
        }
        Some((prefix_t[j] - prefix_t[i]) / nodes[s].speed)
    };
    // best[s][j]: minimal max-stage time placing layers 0..j on stages 0..s (stage s ends at j).
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; l + 1]; n];
    let mut cut = vec![vec![0usize; l + 1]; n];
    for (j, slot) in best[0].iter_mut().enumerate().skip(first_param_layer + 1) {
        if let Some(c) = stage_cost(0, 0, j) {
            *slot = c;
        }
    }
    for s in 1..n {
        for j in (s + 1)..=l {
            for i in s..j {
                if best[s - 1][i] == inf {
                    continue;
                }
                if let Some(c) = stage_cost(s, i, j) {
                    let v = best[s - 1][i].max(c);
                    if v < best[s][j] {
                        best[s][j] = v;
                        cut[s][j] = i;
                    }
                }
            }
        }
    }
    if best[n - 1][l] == inf {
        return Err(PlanError::DoesNotFit {
            needed: prefix_b[l],
            limits: nodes
                .iter()
                .map(|c| c.memory_limit.map_or("none".into(), |m| m.to_string()))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let mut bounds = vec![l];
    let mut j = l;
    for s in (1..n).rev() {
        j = cut[s][j];
        bounds.push(j);
    }
    bounds.push(0);
    bounds.reverse();
    Ok(stages_from_bounds(&bounds, costs, nodes))
}

/// A plan from explicit layer boundaries (`--partition 0:3,3:7,7:10`), validated.
pub fn from_spec(
    spec: &str,
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
) -> Result<Vec<StagePlan>, PlanError> {
    let invalid = |reason: String| PlanError::Invalid {
        given: spec.to_string(),
        reason,
    };
    let mut bounds = vec![0usize];
    for (i, part) in spec.split(',').enumerate() {
        let (a, b) = part
            .split_once(':')
            .ok_or_else(|| invalid(format!("{part:?} is not START:END")))?;
        let (a, b): (usize, usize) = (
            a.trim()
                .parse()
                .map_err(|_| invalid(format!("bad start {a:?}")))?,
            b.trim()
                .parse()
                .map_err(|_| invalid(format!("bad end {b:?}")))?,
        );
        if a != *bounds.last().unwrap_or(&0) {
            return Err(invalid(format!(
                "stage {i} starts at layer {a}, expected {}",
                bounds.last().unwrap_or(&0)
            )));
        }
        if b <= a {
            return Err(invalid(format!("stage {i} ({a}:{b}) has no layers")));
        }
        bounds.push(b);
    }
    if bounds.len() - 1 != nodes.len() {
        return Err(invalid(format!(
            "{} stages for {} nodes",
            bounds.len() - 1,
            nodes.len()
        )));
    }
    if *bounds.last().unwrap_or(&0) != costs.len() {
        return Err(invalid(format!(
            "the stages end at layer {}, the model has {} layers",
            bounds.last().unwrap_or(&0),
            costs.len()
        )));
    }
    if bounds[1] <= first_param_layer {
        return Err(invalid(format!(
            "stage 0 must include layer {first_param_layer} (the first with parameters) so raw inputs never leave the master"
        )));
    }
    let stages = stages_from_bounds(&bounds, costs, nodes);
    for (s, st) in stages.iter().enumerate() {
        if let Some(m) = nodes[s].memory_limit
            && st.predicted_bytes > m
        {
            return Err(invalid(format!(
                "stage {s} needs {} bytes, node {s}'s limit is {m}",
                st.predicted_bytes
            )));
        }
    }
    Ok(stages)
}

fn stages_from_bounds(
    bounds: &[usize],
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
) -> Vec<StagePlan> {
    bounds
        .windows(2)
        .enumerate()
        .map(|(s, w)| StagePlan {
            rank: s as u32,
            start: w[0],
            end: w[1],
            predicted_seconds: costs[w[0]..w[1]].iter().map(|c| c.seconds).sum::<f64>()
                / nodes[s].speed,
            predicted_bytes: costs[w[0]..w[1]].iter().map(|c| c.bytes).sum(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(ts: &[f64]) -> Vec<LayerCost> {
        ts.iter()
            .map(|&t| LayerCost {
                seconds: t,
                bytes: (t * 100.0) as u64,
            })
            .collect()
    }

    fn free(n: usize) -> Vec<NodeCapacity> {
        vec![
            NodeCapacity {
                speed: 1.0,
                memory_limit: None
            };
            n
        ]
    }

    fn bounds(p: &[StagePlan]) -> Vec<(usize, usize)> {
        p.iter().map(|s| (s.start, s.end)).collect()
    }

    #[test]
    fn balances_the_slowest_stage() {
        let p = plan(&costs(&[1.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0]), &free(3), 0).unwrap();
        assert_eq!(bounds(&p), [(0, 4), (4, 5), (5, 7)]);
        assert_eq!(
            p.iter().map(|s| s.predicted_seconds).fold(0.0, f64::max),
            4.0
        );
    }

    #[test]
    fn slow_node_gets_less_work() {
        let mut nodes = free(2);
        nodes[1].speed = 0.25;
        let p = plan(&costs(&[1.0; 10]), &nodes, 0).unwrap();
        assert_eq!(bounds(&p), [(0, 8), (8, 10)]);
    }

    #[test]
    fn memory_limits_are_respected_or_reported() {
        let nodes = vec![
            NodeCapacity {
                speed: 1.0,
                memory_limit: Some(250)
            };
            3
        ];
        let p = plan(&costs(&[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), &nodes, 0).unwrap();
        assert!(p.iter().all(|s| s.predicted_bytes <= 250), "{p:?}");
        let tight = vec![
            NodeCapacity {
                speed: 1.0,
                memory_limit: Some(150)
            };
            3
        ];
        assert!(matches!(
            plan(&costs(&[1.0; 6]), &tight, 0),
            Err(PlanError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn stage_zero_keeps_the_first_parametric_layer() {
        // Layer 0 is a cheap flatten; layer 1 the first linear: stage 0 must not be just layer 0.
        let p = plan(&costs(&[0.0, 5.0, 5.0]), &free(2), 1).unwrap();
        assert_eq!(bounds(&p), [(0, 2), (2, 3)]);
        assert!(from_spec("0:1,1:3", &costs(&[0.0, 5.0, 5.0]), &free(2), 1).is_err());
    }

    #[test]
    fn explicit_partitions_are_validated() {
        let c = costs(&[1.0; 5]);
        assert_eq!(
            bounds(&from_spec("0:2,2:5", &c, &free(2), 0).unwrap()),
            [(0, 2), (2, 5)]
        );
        for bad in ["0:2,3:5", "0:2,2:2,2:5", "0:2,2:4", "0:5", "a:b", "0:2;2:5"] {
            assert!(from_spec(bad, &c, &free(2), 0).is_err(), "{bad}");
        }
        assert!(matches!(
            plan(&c, &free(6), 0),
            Err(PlanError::TooManyNodes { .. })
        ));
    }
}
