//! Partitioning a model's layers into contiguous stages, one per ring node.
//!
//! The planner takes each layer's measured forward+backward time on one micro-batch, its memory
//! (parameters, optimizer state, stashed activations for the in-flight micro-batches) and the
//! size of its output, each node's relative speed (or its own measured time per layer, issue
//! 17.2), memory limit and card (bandwidth and latency, when known), and finds by dynamic programming the contiguous split that minimises the
//! pipeline's bottleneck: the largest, over the nodes, of the node's compute
//! `Σ t_l / speed_s` and the time its card takes to send what it sends per micro-batch (its
//! output activation to its successor, its input's gradient to its predecessor; the master also
//! the logits' gradient), which overlap. Stage 0 always contains the model's first layer with
//! parameters, so what leaves the master is never the raw input (a flatten alone would send the
//! pixels), and every other stage contains a layer with parameters: a stage without any would
//! only relay, paying its card twice per micro-batch for nothing.
//!
//! [`plan_best`] also tries fewer nodes than given (the first `m`): on slow links a cut at a wide
//! activation can cost more than the compute another node saves, and a model has only so many
//! layers with parameters. Nodes that share one machine's cores ([`SharedCores`], the local
//! launcher's processes) add a second bound: every stage's CPU per micro-batch, and what each
//! link costs the CPU at both ends, summed over the nodes and divided by the cores — more nodes
//! than cores only add link work there. Counting links or shared cores, it takes the fewest
//! nodes within 2% of the best bottleneck (fewer hops, a smaller window, less staleness); on
//! compute alone, every node that can hold a layer with parameters.

use serde::{Deserialize, Serialize};

/// Cost of one layer as measured or computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Seconds for forward + backward of one micro-batch.
    pub seconds: f64,
    /// Bytes the layer costs its node whatever the ring's size: parameters, gradients,
    /// optimizer state, and the stashed activations (and weight versions) of the micro-batches
    /// in flight that do not follow the ring's size.
    pub bytes: u64,
    /// Bytes the layer costs its node for each node of the ring: under the async schedule's
    /// default window (one micro-batch in flight per node, and one more) each node adds a
    /// micro-batch's stashed activations and weight version. 0 where the window is fixed.
    #[serde(default)]
    pub bytes_per_node: u64,
    /// Bytes of the layer's output for one micro-batch (what a cut after it sends forward, and
    /// its gradient backward).
    #[serde(default)]
    pub out_bytes: u64,
    /// Whether the layer has parameters.
    #[serde(default = "yes")]
    pub has_params: bool,
    /// Of `seconds`, what a stage that sends its input gradient runs after the send: the
    /// layer's weight gradient and its share of the optimizer step (0 where not measured).
    #[serde(default)]
    pub after_send_seconds: f64,
    /// Under 1F1B, one micro-batch's stashed activations, held once for each micro-batch the
    /// layer's stage keeps in flight — stage `s` of a ring of `n` keeps `min(n − s + 1, M)`
    /// (`StagePolicy::in_flight_limit`), so a ring's first stages hold more than its last. 0
    /// under the other schedules (their stash is in `bytes` and `bytes_per_node`).
    #[serde(default)]
    pub stash_per_in_flight: u64,
    /// `M`, the micro-batches per mini-batch, with `stash_per_in_flight`.
    #[serde(default)]
    pub micro_batches: usize,
    /// Bytes an evaluation pass of one micro-batch through the layer holds: its input, its
    /// output and its side data (one layer at a time: a node's evaluation holds its largest
    /// layer's).
    #[serde(default)]
    pub eval_bytes: u64,
}

fn yes() -> bool {
    true
}

/// Micro-batches stage `stage` of a ring of `nodes` holds at once under 1F1B with
/// `micro_batches` per mini-batch: one more than the stages after it, at most all of them.
pub fn in_flight_at(stage: usize, nodes: usize, micro_batches: usize) -> u64 {
    (nodes.saturating_sub(stage) + 1).min(micro_batches) as u64
}

impl LayerCost {
    /// What the layer costs its node in a ring of `nodes`.
    pub fn bytes_in_ring(&self, nodes: usize) -> u64 {
        self.bytes + self.bytes_per_node * nodes as u64
    }

    /// What the layer costs stage `stage` of a ring of `nodes` (the stash of the micro-batches
    /// that stage keeps in flight included); `stage == nodes` is the head the master holds,
    /// whose micro-batch is forwarded and backwarded at once.
    pub fn bytes_at(&self, stage: usize, nodes: usize) -> u64 {
        self.bytes_in_ring(nodes)
            + self.stash_per_in_flight * in_flight_at(stage, nodes, self.micro_batches)
    }
}

/// A node's capacity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeCapacity {
    /// Relative speed in (0, 1]; a node at 0.5 takes twice as long for the same work.
    pub speed: f64,
    /// Most bytes the node may hold (`None` = unlimited).
    pub memory_limit: Option<u64>,
    /// What its card sends, bytes per second (`None`: not known, links not counted).
    #[serde(default)]
    pub card_bytes_per_second: Option<f64>,
    /// One-way latency of its links, seconds.
    #[serde(default)]
    pub latency_seconds: f64,
    /// The node's own measured seconds per layer (its profile at rendezvous), used instead of
    /// the shared costs' seconds when there is one per layer; still divided by `speed` (an
    /// emulated slowdown on top of the hardware).
    #[serde(default)]
    pub layer_seconds: Option<Vec<f64>>,
    /// CPU seconds per byte its links take from its compute (framing, sealing and opening;
    /// counted where the node has no core to spare for them): added to its compute for what
    /// it sends and receives per micro-batch. 0: not counted.
    #[serde(default)]
    pub link_cpu_seconds_per_byte: f64,
}

impl NodeCapacity {
    /// A node of `speed` with no memory limit and links not counted.
    pub fn with_speed(speed: f64) -> Self {
        Self {
            speed,
            memory_limit: None,
            card_bytes_per_second: None,
            latency_seconds: 0.0,
            layer_seconds: None,
            link_cpu_seconds_per_byte: 0.0,
        }
    }

    /// Seconds of compute for layers `i..j` of `costs` on this node: its own measured figures
    /// when it has one per layer, else the shared costs; divided by its speed.
    fn compute_seconds(&self, costs: &[LayerCost], i: usize, j: usize) -> f64 {
        let seconds: f64 = match &self.layer_seconds {
            Some(own) if own.len() == costs.len() => own[i..j].iter().sum(),
            _ => costs[i..j].iter().map(|c| c.seconds).sum(),
        };
        seconds / self.speed
    }

    /// Of [`NodeCapacity::compute_seconds`] for layers `i..j`, what runs after the stage has
    /// sent its input gradient: each layer's share of it in the shared costs, applied to this
    /// node's own figures where it has them.
    fn after_send_seconds(&self, costs: &[LayerCost], i: usize, j: usize) -> f64 {
        let share = |c: &LayerCost| {
            if c.seconds > 0.0 {
                (c.after_send_seconds / c.seconds).clamp(0.0, 1.0)
            } else {
                0.0
            }
        };
        let seconds: f64 = match &self.layer_seconds {
            Some(own) if own.len() == costs.len() => {
                (i..j).map(|l| own[l] * share(&costs[l])).sum()
            }
            _ => costs[i..j].iter().map(|c| c.seconds * share(c)).sum(),
        };
        seconds / self.speed
    }

    /// Seconds its card takes for `bytes` (0 when its rate is not known).
    fn send_seconds(&self, bytes: u64) -> f64 {
        self.card_bytes_per_second
            .filter(|r| *r > 0.0)
            .map_or(0.0, |r| bytes as f64 / r)
    }
}

/// Nodes that share one machine's cores without CPU quotas: together they cannot go faster
/// than their summed CPU per micro-batch over the cores allows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedCores {
    /// Cores the nodes share.
    pub cores: f64,
    /// Compute threads per node: a stage's compute seconds keep that many cores busy.
    pub threads: usize,
    /// CPU seconds per byte a link costs, its two ends together (framing, sealing and
    /// opening; `link_cost`), for what every stage sends per micro-batch.
    pub link_cpu_seconds_per_byte: f64,
}

impl SharedCores {
    /// Seconds per micro-batch the shared cores need for `stages`: every stage's predicted
    /// compute times its threads, and every byte its links carry, over the cores. (A stage's
    /// predicted seconds already hold its node's own link work where its profile counted it;
    /// the local launcher's nodes have no profiles of their own, so nothing is counted twice.)
    pub fn pace(&self, costs: &[LayerCost], stages: &[StagePlan]) -> f64 {
        let cpu: f64 = stages
            .iter()
            .enumerate()
            .map(|(s, st)| {
                st.predicted_seconds * self.threads.max(1) as f64 + self.link_seconds(costs, s, st)
            })
            .sum();
        cpu / self.cores.max(1e-9)
    }

    /// The cores, for a message: `1 core`, `2 cores`.
    pub fn cores_named(&self) -> String {
        if self.cores == 1.0 {
            "1 core".to_string()
        } else {
            format!("{} cores", self.cores)
        }
    }

    /// CPU seconds per micro-batch that what stage `s` sends costs at both ends of its links.
    pub fn link_seconds(&self, costs: &[LayerCost], s: usize, stage: &StagePlan) -> f64 {
        let (forward, backward) = sent_bytes(costs, s, stage.start, stage.end);
        (forward + backward) as f64 * self.link_cpu_seconds_per_byte
    }
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
    /// Predicted seconds per micro-batch its card sends (0 when links are not counted).
    #[serde(default)]
    pub predicted_link_seconds: f64,
}

impl StagePlan {
    /// What limits this stage's pace: its compute or its card, whichever is longer.
    pub fn bottleneck(&self) -> f64 {
        self.predicted_seconds.max(self.predicted_link_seconds)
    }
}

/// A plan with what it predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// One stage per node the plan uses (ranks 0…m−1).
    pub stages: Vec<StagePlan>,
    /// The slowest stage's pace (compute or card), seconds per micro-batch.
    pub bottleneck: f64,
    /// A micro-batch's trip around the ring and back: every stage's compute, and every
    /// activation and gradient on its link (card time and latency), seconds.
    pub round_trip: f64,
    /// The bottleneck with each number of nodes that has a plan (nodes, seconds).
    pub by_nodes: Vec<(usize, f64)>,
}

impl Plan {
    /// Micro-batches that must be in flight to keep the slowest stage busy: the round trip
    /// over the bottleneck, at least one per node, and one more for what the model leaves out
    /// of a micro-batch's trip (encoding and decoding its messages, the emulator's timer ticks,
    /// waiting behind the micro-batch before it on a card). Measured
    /// (docs/benchmarks/logs/log-09.md): on a 2-node ring at 100 Mbit/s the round trip took 84 ms against 57 ms
    /// predicted; on 2 pinned loopback nodes (mlp-deep) a window of 2 ran 4,398–4,658
    /// samples/s and 3 ran 5,072, and the default run lost nothing to a window of 5.
    pub fn window(&self) -> usize {
        let covering = (self.round_trip / self.bottleneck.max(1e-12))
            .ceil()
            .min(1e6) as usize;
        covering.max(self.stages.len()) + 1
    }
}

/// Why no plan exists.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// More nodes than layers: some stage would be empty.
    #[error(
        "{nodes} nodes but only {layers} blocks of layers with parameters to place (the first \
         node's block runs up to the first layer with parameters; a node without parameters \
         would only relay): every node needs at least one layer with parameters"
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

/// Per-micro-batch cost of stage `s` of `n` holding layers `i..j`: (compute seconds, card
/// seconds). What its card sends: its output (to its successor, or the logits to the master),
/// its input's gradient (to its predecessor) unless it is the master, and on the master the
/// gradient of what came back to it (the same size as the last layer's output).
fn stage_costs(
    costs: &[LayerCost],
    node: &NodeCapacity,
    s: usize,
    i: usize,
    j: usize,
) -> (f64, f64) {
    let (forward, backward) = sent_bytes(costs, s, i, j);
    // It receives as many bytes as it sends (an activation for each gradient, and back).
    let link_work = (forward + backward) as f64 * node.link_cpu_seconds_per_byte;
    let compute = node.compute_seconds(costs, i, j) + link_work;
    (compute, node.send_seconds(forward + backward))
}

/// Bytes stage `s` holding layers `i..j` sends per micro-batch: forward, its output (to its
/// successor, or the logits to the master); backward, the gradient of its input (to its
/// predecessor) or, on the master, the gradient of what came back to it (the size of the last
/// layer's output).
fn sent_bytes(costs: &[LayerCost], s: usize, i: usize, j: usize) -> (u64, u64) {
    let backward = if s > 0 {
        costs[i - 1].out_bytes
    } else {
        costs.last().map_or(0, |c| c.out_bytes)
    };
    (costs[j - 1].out_bytes, backward)
}

/// Whether any node's card is known, so that links count in the plan.
pub fn links_counted(nodes: &[NodeCapacity]) -> bool {
    nodes.iter().any(|c| c.card_bytes_per_second.is_some())
}

/// Finds the plan minimising the pipeline's bottleneck on every node given. `first_param_layer`
/// must fall into stage 0.
pub fn plan(
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
) -> Result<Vec<StagePlan>, PlanError> {
    split(costs, nodes, first_param_layer, &[]).map(|(stages, _)| stages)
}

/// The best plan on the first `m` nodes for every `m` from 2 to all of them (all of them only
/// when `use_all`), taking the fewest nodes whose bottleneck is within 2% of the best. With
/// `shared` cores a plan's bottleneck is also at least their [`SharedCores::pace`]: the
/// programme balances the stages of each `m`, then the cores cap its pace (of what the cores
/// carry, only the links' bytes depend on where the cuts fall, a few percent of it).
pub fn plan_best(
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
    use_all: bool,
    shared: Option<&SharedCores>,
) -> Result<Plan, PlanError> {
    plan_best_around(costs, nodes, first_param_layer, use_all, shared, &[])
}

/// [`plan_best`] with a stage boundary at each of `bounds` (layer positions: a stage ends before
/// each), as the cuts a user gives inside layers need (`--cut-inside L:S`: the head ends one
/// stage, the tail starts the next). Node counts too small for them are not tried.
pub fn plan_best_around(
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
    use_all: bool,
    shared: Option<&SharedCores>,
    bounds: &[usize],
) -> Result<Plan, PlanError> {
    let counts: Vec<usize> = if use_all || nodes.len() < 3 {
        vec![nodes.len()]
    } else {
        (2..=nodes.len()).collect()
    };
    let mut found: Vec<(Vec<StagePlan>, f64)> = Vec::new();
    let mut first_error = None;
    for m in counts.into_iter().filter(|m| *m > bounds.len()) {
        match split(costs, &nodes[..m], first_param_layer, bounds) {
            Ok((stages, bottleneck)) => {
                let cores = shared.map_or(0.0, |c| c.pace(costs, &stages));
                found.push((stages, bottleneck.max(cores)));
            }
            Err(e) => {
                // Fewer nodes may not fit where more do, and more may have nothing to hold:
                // the error of the most nodes that had layers to hold says why.
                let too_many = matches!(e, PlanError::TooManyNodes { .. });
                if first_error.is_none() || !too_many {
                    first_error = Some(e);
                }
            }
        }
    }
    let best = found.iter().map(|(_, b)| *b).fold(f64::INFINITY, f64::min);
    let by_nodes: Vec<(usize, f64)> = found.iter().map(|(p, b)| (p.len(), *b)).collect();
    // Counting the cards or shared cores, fewer nodes mean fewer hops, a smaller window and
    // less staleness: the fewest within 2% of the best. Without them (compute alone), splitting
    // a stage never slows the slowest one, so every node that can hold parameters is used.
    let fewest = links_counted(nodes) || shared.is_some();
    let near_best = |b: &f64| *b <= best * 1.02;
    let chosen = if fewest {
        found.into_iter().find(|(_, b)| near_best(b))
    } else {
        found.into_iter().rev().find(|(_, b)| near_best(b))
    };
    let Some((stages, bottleneck)) = chosen else {
        return Err(first_error.unwrap_or(PlanError::TooManyNodes {
            nodes: nodes.len(),
            layers: 0,
        }));
    };
    let round_trip = round_trip(costs, &stages, nodes);
    Ok(Plan {
        stages,
        bottleneck,
        round_trip,
        by_nodes,
    })
}

/// A micro-batch's round trip through `stages`: their compute, and each activation and gradient
/// on the sending node's card plus its latency. A stage after the master sends its input
/// gradient before its weight gradients and step (`Stage::backward_sending`): those are off the
/// trip.
pub fn round_trip(costs: &[LayerCost], stages: &[StagePlan], nodes: &[NodeCapacity]) -> f64 {
    let n = stages.len();
    let mut total = 0.0;
    for (s, st) in stages.iter().enumerate() {
        total += st.predicted_seconds;
        if s > 0 {
            total -= nodes[s].after_send_seconds(costs, st.start, st.end);
        }
        let node = &nodes[s];
        let (forward, backward) = sent_bytes(costs, s, st.start, st.end);
        total += node.send_seconds(forward) + node.latency_seconds;
        if n > 1 {
            total += node.send_seconds(backward) + node.latency_seconds;
        }
    }
    total
}

/// The dynamic programme: the split of `costs` over exactly `nodes.len()` stages with the
/// smallest bottleneck, and that bottleneck.
fn split(
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
    bounds: &[usize],
) -> Result<(Vec<StagePlan>, f64), PlanError> {
    let (l, n) = (costs.len(), nodes.len());
    // Stage 0 holds every layer up to the first with parameters; every other stage holds one
    // with parameters.
    let params_after = costs
        .iter()
        .skip(first_param_layer.min(l) + 1)
        .filter(|c| c.has_params)
        .count();
    let blocks = params_after + 1;
    if n > blocks || l == 0 {
        return Err(PlanError::TooManyNodes {
            nodes: n,
            layers: blocks,
        });
    }
    let prefix_b: Vec<u64> = std::iter::once(0)
        .chain(costs.iter().scan(0, |a, c| {
            *a += c.bytes_in_ring(n);
            Some(*a)
        }))
        .collect();
    // Under 1F1B, per micro-batch in flight, which depends on the stage's place.
    let prefix_stash: Vec<u64> = std::iter::once(0)
        .chain(costs.iter().scan(0, |a, c| {
            *a += c.stash_per_in_flight;
            Some(*a)
        }))
        .collect();
    let micro_batches = costs.first().map_or(0, |c| c.micro_batches);
    let prefix_p: Vec<usize> = std::iter::once(0)
        .chain(costs.iter().scan(0, |a, c| {
            *a += usize::from(c.has_params);
            Some(*a)
        }))
        .collect();
    let stage_cost = |s: usize, i: usize, j: usize| -> Option<f64> {
        if bounds.iter().any(|b| i < *b && *b < j) {
            // A stage across a boundary that must be.
            return None;
        }
        let bytes = prefix_b[j] - prefix_b[i]
            + (prefix_stash[j] - prefix_stash[i]) * in_flight_at(s, n, micro_batches);
        if nodes[s].memory_limit.is_some_and(|m| bytes > m) {
            return None;
        }
        if s > 0 && prefix_p[j] == prefix_p[i] {
            // Only relays.
            return None;
        }
        let (compute, link) = stage_costs(costs, &nodes[s], s, i, j);
        Some(compute.max(link))
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
    Ok((stages_from_bounds(&bounds, costs, nodes), best[n - 1][l]))
}

/// `--partition`: each stage's layers, `START:END` ranges that follow one another from layer 0
/// (`0:4,4:8,8:10`); held as the boundaries between them (`[0, 4, 8, 10]`). Whether they fit the
/// model and the nodes is the planner's check ([`from_spec`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageRanges {
    /// Layer 0, then where each stage ends.
    pub bounds: Vec<usize>,
}

impl std::str::FromStr for StageRanges {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let mut bounds = vec![0usize];
        for (i, part) in text.split(',').enumerate() {
            let (a, b) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?} is not START:END"))?;
            let (a, b): (usize, usize) = (
                a.trim().parse().map_err(|_| format!("bad start {a:?}"))?,
                b.trim().parse().map_err(|_| format!("bad end {b:?}"))?,
            );
            let expected = bounds.last().copied().unwrap_or(0);
            if a != expected {
                return Err(format!(
                    "stage {i} starts at layer {a}, expected {expected}"
                ));
            }
            if b <= a {
                return Err(format!("stage {i} ({a}:{b}) has no layers"));
            }
            bounds.push(b);
        }
        Ok(Self { bounds })
    }
}

impl std::fmt::Display for StageRanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .bounds
            .windows(2)
            .map(|w| format!("{}:{}", w[0], w[1]))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// A plan from explicit layer boundaries (`--partition 0:3,3:7,7:10`), checked against the
/// model and the nodes.
pub fn from_spec(
    ranges: &StageRanges,
    costs: &[LayerCost],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
) -> Result<Vec<StagePlan>, PlanError> {
    let invalid = |reason: String| PlanError::Invalid {
        given: ranges.to_string(),
        reason,
    };
    let bounds = &ranges.bounds;
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
    let stages = stages_from_bounds(bounds, costs, nodes);
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
        .map(|(s, w)| {
            let (compute, link) = stage_costs(costs, &nodes[s], s, w[0], w[1]);
            StagePlan {
                rank: s as u32,
                start: w[0],
                end: w[1],
                predicted_seconds: compute,
                predicted_bytes: costs[w[0]..w[1]]
                    .iter()
                    .map(|c| c.bytes_at(s, bounds.len() - 1))
                    .sum(),
                predicted_link_seconds: link,
            }
        })
        .collect()
}

/// A linear layer cut by its output features between two adjacent stages (its head ends one,
/// its tail starts the next; `ringtmp_model::layers::cut_linear`): a finer cut than whole layers,
/// for a balance whole layers cannot give.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CutInside {
    /// The layer's position in the model's (uncut) layer list.
    pub layer: usize,
    /// Output features its head computes.
    pub split: usize,
}

/// A linear layer's geometry, where the planner may cut inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cuttable {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

/// Splits granularity: a cut falls after a multiple of this many output features (the GEMM
/// kernels' tile height, so neither half runs a ragged tile more than the whole did).
pub const CUT_GRANULE: usize = 64;

/// Layers with fewer output features are not cut: a few granules leave too coarse a choice to
/// balance anything, and such layers are too small to be a bottleneck worth a second message
/// part.
pub const MIN_CUT_FEATURES: usize = 4 * CUT_GRANULE;

/// A cut must lower the bottleneck by this share...
const MIN_CUT_GAIN: f64 = 0.02;

/// ...and by at least this many seconds a micro-batch: a message's fixed cost on loopback is
/// about a tenth of a millisecond (`ringtmp selftest`: round trips of 0.10 ms at the median), so a
/// smaller predicted gain is inside what the model leaves out — and a plan that flips on timing
/// noise would make two runs of one configuration compute (by rounding) differently.
const MIN_CUT_SECONDS: f64 = 1e-4;

/// `costs` and `nodes` (their own per-layer figures) with `cuts` made, as [`cut_inside`] prices
/// them: what a plan over the cut model's layers is found on.
///
/// # Panics
/// If a cut's layer is not in `geometry` as cuttable (a programmer error: callers validate).
pub fn apply_cuts(
    costs: &[LayerCost],
    geometry: &[Option<Cuttable>],
    nodes: &[NodeCapacity],
    cuts: &[CutInside],
) -> (Vec<LayerCost>, Vec<NodeCapacity>) {
    let (mut work, mut geom) = (costs.to_vec(), geometry.to_vec());
    let mut origin: Vec<usize> = (0..costs.len()).collect();
    let mut caps = nodes.to_vec();
    let mut sorted = cuts.to_vec();
    // From the last, so that each cut's model position is still its position in the list.
    sorted.sort_by_key(|c| std::cmp::Reverse(c.layer));
    for cut in sorted {
        let g = geom[cut.layer].expect("a validated cut is of a linear layer");
        cut_costs(&mut work, &mut geom, &mut origin, cut.layer, cut.split);
        cut_nodes(
            &mut caps,
            cut.layer,
            cut.split as f64 / g.out_features as f64,
        );
    }
    (work, caps)
}

/// A plan refined by cuts inside layers: the cuts, and the costs of the cut model's layers
/// (what the plan's stage bounds index).
#[derive(Clone, Debug, PartialEq)]
pub struct RefinedPlan {
    /// The plan over the cut model's layers.
    pub plan: Plan,
    /// The cuts, in the model's layer positions, ascending.
    pub cuts: Vec<CutInside>,
    /// Per layer of the cut model, its cost.
    pub costs: Vec<LayerCost>,
}

/// The stages `bounds` make of `work` on `caps`, and their pace (the slowest stage's, or the
/// shared cores'), if every stage has parameters and fits its node's memory limit.
fn fitting_stages(
    bounds: &[usize],
    work: &[LayerCost],
    caps: &[NodeCapacity],
    shared: Option<&SharedCores>,
) -> Option<(Vec<StagePlan>, f64)> {
    let stages = stages_from_bounds(bounds, work, caps);
    for (s, st) in stages.iter().enumerate() {
        let has_params = work[st.start..st.end].iter().any(|c| c.has_params);
        let fits = caps[s]
            .memory_limit
            .is_none_or(|limit| st.predicted_bytes <= limit);
        if !has_params || !fits {
            return None;
        }
    }
    let slowest = stages.iter().map(StagePlan::bottleneck).fold(0.0, f64::max);
    let pace = shared.map_or(0.0, |c| c.pace(work, &stages));
    Some((stages, slowest.max(pace)))
}

/// `costs` (and `geometry`, `origin`: per layer, whether it may be cut, and its position in the
/// uncut model) with layer `at` replaced by its head and tail cut after `split` outputs: each
/// gets its share of the layer's compute and state by rows; the head's output is the layer's
/// input and the head's outputs (`[x | y_A]`, what the cut sends forward and its gradient back).
fn cut_costs(
    costs: &mut Vec<LayerCost>,
    geometry: &mut Vec<Option<Cuttable>>,
    origin: &mut Vec<usize>,
    at: usize,
    split: usize,
) {
    let Some(g) = geometry[at] else { return };
    let c = costs[at];
    let share = split as f64 / g.out_features as f64;
    let input_bytes = if at > 0 { costs[at - 1].out_bytes } else { 0 };
    let part = |f: f64, out_bytes: u64| LayerCost {
        seconds: c.seconds * f,
        bytes: (c.bytes as f64 * f).round() as u64,
        bytes_per_node: (c.bytes_per_node as f64 * f).round() as u64,
        out_bytes,
        has_params: true,
        after_send_seconds: c.after_send_seconds * f,
        stash_per_in_flight: (c.stash_per_in_flight as f64 * f).round() as u64,
        micro_batches: c.micro_batches,
        eval_bytes: c.eval_bytes,
    };
    let head = part(
        share,
        input_bytes + (c.out_bytes as f64 * share).round() as u64,
    );
    let tail = part(1.0 - share, c.out_bytes);
    costs.splice(at..=at, [head, tail]);
    geometry.splice(at..=at, [None, None]);
    let o = origin[at];
    origin.splice(at..=at, [o, o]);
}

/// `nodes` with their own per-layer seconds cut as [`cut_costs`] cuts the shared ones.
fn cut_nodes(nodes: &mut [NodeCapacity], at: usize, share: f64) {
    for node in nodes {
        if let Some(own) = node.layer_seconds.as_mut()
            && at < own.len()
        {
            let t = own[at];
            own.splice(at..=at, [t * share, t * (1.0 - share)]);
        }
    }
}

/// Refines `plan` (whole layers, on the first `plan.stages.len()` of `nodes`) by cutting linear
/// layers inside where that lowers the bottleneck: at each boundary at most one cut, of the last
/// linear layer before it (its tail and the parameter-free layers after it move to the next
/// stage) or of the first one after it (the parameter-free layers before it and its head move to
/// the previous stage), after a multiple of [`CUT_GRANULE`] outputs. Greedy: the cut that lowers
/// the bottleneck most, then again, while one lowers it by 2% and 0.1 ms more; only layers of
/// at least [`MIN_CUT_FEATURES`] outputs. Never cuts the first layer
/// with parameters before its input leaves the master (the cut would send that input, the raw
/// data). `None` when no cut helps.
pub fn cut_inside(
    costs: &[LayerCost],
    geometry: &[Option<Cuttable>],
    nodes: &[NodeCapacity],
    plan: &Plan,
    first_param_layer: usize,
    shared: Option<&SharedCores>,
) -> Option<RefinedPlan> {
    let m = plan.stages.len();
    let mut work = costs.to_vec();
    let mut geom = geometry.to_vec();
    let mut origin: Vec<usize> = (0..costs.len()).collect();
    let mut caps: Vec<NodeCapacity> = nodes[..m].to_vec();
    let mut bounds: Vec<usize> = std::iter::once(0)
        .chain(plan.stages.iter().map(|s| s.end))
        .collect();
    let mut cuts = Vec::new();
    let evaluate = |work: &[LayerCost], caps: &[NodeCapacity], bounds: &[usize]| {
        fitting_stages(bounds, work, caps, shared)
    };
    let (_, mut current) = evaluate(&work, &caps, &bounds)?;
    loop {
        let mut best: Option<(f64, usize, usize, usize)> = None; // (bottleneck, boundary, layer, split)
        for k in 1..m {
            let (lo, j, hi) = (bounds[k - 1], bounds[k], bounds[k + 1]);
            // The last layer with parameters before the boundary, with nothing but
            // parameter-free layers after it in its stage; the first after it, likewise.
            let before = (lo..j).rev().find(|&l| work[l].has_params);
            let after = (j..hi).find(|&l| work[l].has_params);
            for layer in [before, after].into_iter().flatten() {
                let Some(g) = geom[layer].filter(|g| g.out_features >= MIN_CUT_FEATURES) else {
                    continue;
                };
                if origin[layer] == first_param_layer && layer < j && k == 1 {
                    // Stage 0 would send this layer's input: the raw data.
                    continue;
                }
                for split in (CUT_GRANULE..g.out_features).step_by(CUT_GRANULE) {
                    let (mut w, mut gm, mut o) = (work.clone(), geom.clone(), origin.clone());
                    cut_costs(&mut w, &mut gm, &mut o, layer, split);
                    let mut c = caps.clone();
                    cut_nodes(&mut c, layer, split as f64 / g.out_features as f64);
                    // The boundary falls between head and tail; later bounds shift by one.
                    let mut b: Vec<usize> = bounds
                        .iter()
                        .map(|&x| if x > layer { x + 1 } else { x })
                        .collect();
                    b[k] = layer + 1;
                    if let Some((_, bottleneck)) = evaluate(&w, &c, &b)
                        && best.is_none_or(|(v, ..)| bottleneck < v)
                    {
                        best = Some((bottleneck, k, layer, split));
                    }
                }
            }
        }
        match best {
            Some((bottleneck, k, layer, split))
                if bottleneck < current * (1.0 - MIN_CUT_GAIN)
                    && current - bottleneck >= MIN_CUT_SECONDS =>
            {
                let g = geom[layer].expect("a candidate is cuttable");
                cuts.push(CutInside {
                    layer: origin[layer],
                    split,
                });
                cut_costs(&mut work, &mut geom, &mut origin, layer, split);
                cut_nodes(&mut caps, layer, split as f64 / g.out_features as f64);
                for x in bounds.iter_mut() {
                    if *x > layer {
                        *x += 1;
                    }
                }
                bounds[k] = layer + 1;
                current = bottleneck;
            }
            _ => break,
        }
    }
    if cuts.is_empty() {
        return None;
    }
    let (stages, bottleneck) = evaluate(&work, &caps, &bounds)?;
    let round_trip = round_trip(&work, &stages, &caps);
    cuts.sort_by_key(|c| c.layer);
    Some(RefinedPlan {
        plan: Plan {
            stages,
            bottleneck,
            round_trip,
            by_nodes: plan.by_nodes.clone(),
        },
        cuts,
        costs: work,
    })
}

/// Where no partition of whole layers fits the nodes' memory: fills the nodes in ring order,
/// each with as many layers as its limit holds, and may cut the linear layer that would overflow
/// a node so that its head fills what the node has left (after a multiple of [`CUT_GRANULE`]
/// outputs) and its tail starts the next node. A layer is cut at most once, so filling a node to
/// the brim can leave the next one a tail it cannot hold: each node tries the cut first, then the
/// whole-layer boundary (a search over at most two choices a node). Memory comes first here,
/// speed second. Only layers of at least [`MIN_CUT_FEATURES`] outputs are cut, and never the
/// first layer with parameters on the master (its tail would need the raw data). `None` when no
/// such split fits.
pub fn fit_by_cutting(
    costs: &[LayerCost],
    geometry: &[Option<Cuttable>],
    nodes: &[NodeCapacity],
    first_param_layer: usize,
    shared: Option<&SharedCores>,
) -> Option<RefinedPlan> {
    let start = Filling {
        work: costs.to_vec(),
        geom: geometry.to_vec(),
        origin: (0..costs.len()).collect(),
        caps: nodes.to_vec(),
        cuts: Vec::new(),
        bounds: vec![0],
    };
    let Filling {
        work,
        caps,
        mut cuts,
        bounds,
        ..
    } = start.fill(0, first_param_layer)?;
    if cuts.is_empty() {
        return None;
    }
    let (stages, bottleneck) = fitting_stages(&bounds, &work, &caps, shared)?;
    let round_trip = round_trip(&work, &stages, &caps);
    cuts.sort_by_key(|c| c.layer);
    Some(RefinedPlan {
        plan: Plan {
            by_nodes: vec![(stages.len(), bottleneck)],
            stages,
            bottleneck,
            round_trip,
        },
        cuts,
        costs: work,
    })
}

/// The share of a node's memory limit [`fit_by_cutting`] fills.
const FILL_MARGIN: f64 = 0.95;

/// A partial split of [`fit_by_cutting`]: the model's layers with the cuts made so far, and the
/// nodes' bounds so far.
#[derive(Clone)]
struct Filling {
    work: Vec<LayerCost>,
    geom: Vec<Option<Cuttable>>,
    origin: Vec<usize>,
    caps: Vec<NodeCapacity>,
    cuts: Vec<CutInside>,
    bounds: Vec<usize>,
}

impl Filling {
    /// What node `k` holds with layers `a..b`.
    fn held(&self, k: usize, a: usize, b: usize) -> u64 {
        let m = self.caps.len();
        self.work[a..b].iter().map(|c| c.bytes_at(k, m)).sum()
    }

    /// Fills node `k` on from where the split stands, then the nodes after it; the first
    /// complete split found (a cut preferred to a whole-layer boundary at each node).
    fn fill(self, k: usize, first_param_layer: usize) -> Option<Self> {
        let start = *self.bounds.last().expect("bounds start at 0");
        if start == self.work.len() {
            return Some(self);
        }
        if k == self.caps.len() {
            return None;
        }
        // Filled to a margin below the limit: the memory model is a prediction, and a node
        // filled to the brim is the first one an evaluation's larger batches push over.
        let limit = self.caps[k]
            .memory_limit
            .map_or(u64::MAX, |l| (l as f64 * FILL_MARGIN) as u64);
        let mut end = start;
        while end < self.work.len() && self.held(k, start, end + 1) <= limit {
            end += 1;
        }
        let cuttable = self
            .geom
            .get(end)
            .copied()
            .flatten()
            .filter(|g| g.out_features >= MIN_CUT_FEATURES);
        let raw_data = self.origin.get(end) == Some(&first_param_layer) && k == 0;
        if end < self.work.len()
            && k + 1 < self.caps.len()
            && !raw_data
            && let Some(g) = cuttable
        {
            // The largest head that still fits this node.
            let cut_at = |split: usize| {
                let mut next = self.clone();
                cut_costs(&mut next.work, &mut next.geom, &mut next.origin, end, split);
                next
            };
            let fitting = (CUT_GRANULE..g.out_features)
                .step_by(CUT_GRANULE)
                .rev()
                .map(|split| (split, cut_at(split)))
                .find(|(_, next)| next.held(k, start, end + 1) <= limit);
            if let Some((split, mut next)) = fitting {
                next.cuts.push(CutInside {
                    layer: self.origin[end],
                    split,
                });
                cut_nodes(&mut next.caps, end, split as f64 / g.out_features as f64);
                next.bounds.push(end + 1);
                if let Some(done) = next.fill(k + 1, first_param_layer) {
                    return Some(done);
                }
            }
        }
        if end == start {
            return None;
        }
        let mut next = self;
        next.bounds.push(end);
        next.fill(k + 1, first_param_layer)
    }
}

/// A plan with cuts inside layers where they help, over every node count [`plan_best`] weighs:
/// each count's best whole-layer plan refined by [`cut_inside`], then the same choice among the
/// counts as [`plan_best`]'s (the fewest within 2% of the best where links or shared cores are
/// counted, else the most). Refining only the count whole layers chose missed the better plan:
/// on two shared cores, whole layers put the default run on 3 nodes (2.98 ms against 3.28 ms a
/// micro-batch on 2), where 2 nodes with a cut do as well (2.93 ms) — and train 8–13% faster
/// (docs/benchmarks/logs/log-24.md). `whole` is [`plan_best`]'s plan for the same arguments;
/// `None` where the choice is `whole` itself.
pub fn plan_best_cut(
    costs: &[LayerCost],
    geometry: &[Option<Cuttable>],
    nodes: &[NodeCapacity],
    whole: &Plan,
    first_param_layer: usize,
    shared: Option<&SharedCores>,
) -> Option<RefinedPlan> {
    // (nodes, whole-layer plan, its refinement)
    let mut tried: Vec<(usize, Plan, Option<RefinedPlan>)> = Vec::new();
    for &(m, _) in &whole.by_nodes {
        let at_m = if m == whole.stages.len() {
            Ok(whole.clone())
        } else {
            plan_best(costs, &nodes[..m], first_param_layer, true, shared)
        };
        let Ok(at_m) = at_m else { continue };
        let refined = cut_inside(costs, geometry, nodes, &at_m, first_param_layer, shared);
        tried.push((m, at_m, refined));
    }
    let bottleneck = |t: &(usize, Plan, Option<RefinedPlan>)| {
        t.2.as_ref().map_or(t.1.bottleneck, |r| r.plan.bottleneck)
    };
    let best = tried.iter().map(bottleneck).fold(f64::INFINITY, f64::min);
    let by_nodes: Vec<(usize, f64)> = tried.iter().map(|t| (t.0, bottleneck(t))).collect();
    let fewest = links_counted(nodes) || shared.is_some();
    let near_best = |t: &&(usize, Plan, Option<RefinedPlan>)| bottleneck(t) <= best * 1.02;
    let chosen = if fewest {
        tried.iter().find(near_best)
    } else {
        tried.iter().rev().find(near_best)
    }?;
    let mut refined = match &chosen.2 {
        Some(refined) => refined.clone(),
        None if chosen.0 == whole.stages.len() => return None,
        // Whole layers on another count: some count's cut lowered the best.
        None => RefinedPlan {
            plan: chosen.1.clone(),
            cuts: Vec::new(),
            costs: costs.to_vec(),
        },
    };
    refined.plan.by_nodes = by_nodes;
    Some(refined)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(ts: &[f64]) -> Vec<LayerCost> {
        ts.iter()
            .map(|&t| LayerCost {
                seconds: t,
                bytes: (t * 100.0) as u64,
                bytes_per_node: 0,
                out_bytes: 0,
                has_params: true,
                after_send_seconds: 0.0,
                ..Default::default()
            })
            .collect()
    }

    fn free(n: usize) -> Vec<NodeCapacity> {
        vec![NodeCapacity::with_speed(1.0); n]
    }

    fn bounds(p: &[StagePlan]) -> Vec<(usize, usize)> {
        p.iter().map(|s| (s.start, s.end)).collect()
    }

    /// Boundaries that must be (a user's cuts inside layers) hold even where the best plan
    /// without them lies elsewhere: [1 1 1 1 4 1 1] on 3 nodes is best cut 0..4 | 4..5 | 5..7
    /// (4.0); with a boundary before layer 2 a stage ends there and the bottleneck is 6.0 (layers
    /// 2..5 or 4..7 together); with boundaries before 2 and 5 the plan is 0..2 | 2..5 | 5..7.
    /// Two boundaries need three nodes.
    #[test]
    fn given_boundaries_are_kept() {
        let c = costs(&[1.0, 1.0, 1.0, 1.0, 4.0, 1.0, 1.0]);
        let free_plan = plan_best(&c, &free(3), 0, true, None).unwrap();
        assert_eq!(bounds(&free_plan.stages), [(0, 4), (4, 5), (5, 7)]);
        let held = plan_best_around(&c, &free(3), 0, true, None, &[2]).unwrap();
        assert!(held.stages.iter().any(|s| s.end == 2), "{held:?}");
        assert_eq!(held.bottleneck, 6.0);
        let two = plan_best_around(&c, &free(3), 0, true, None, &[2, 5]).unwrap();
        assert_eq!(bounds(&two.stages), [(0, 2), (2, 5), (5, 7)]);
        // Fewer nodes allowed: none below the boundaries' count is tried.
        let fewer = plan_best_around(&c, &free(3), 0, false, None, &[2, 5]).unwrap();
        assert_eq!(fewer.stages.len(), 3);
        assert!(plan_best_around(&c, &free(2), 0, true, None, &[2, 5]).is_err());
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

    // A node's own profile replaces the shared costs, layer by layer: a board
    // whose second layer is 4× slower than on the master (but whose others are as fast) gets
    // the split that keeps that layer off it, which no single speed factor would find.
    #[test]
    fn own_layer_seconds_replace_the_shared_costs_per_node() {
        let shared = costs(&[1.0, 1.0, 1.0, 1.0]);
        let mut nodes = free(2);
        let p = plan(&shared, &nodes, 0).unwrap();
        assert_eq!(bounds(&p), [(0, 2), (2, 4)]);
        nodes[1].layer_seconds = Some(vec![1.0, 1.0, 4.0, 1.0]);
        let p = plan(&shared, &nodes, 0).unwrap();
        assert_eq!(bounds(&p), [(0, 3), (3, 4)]);
        assert_eq!((p[0].predicted_seconds, p[1].predicted_seconds), (3.0, 1.0));
        // With a speed on top (an emulated slowdown), both count.
        nodes[1].speed = 0.5;
        let p = plan(&shared, &nodes, 0).unwrap();
        assert_eq!(p[1].predicted_seconds, 2.0);
        // The node's link work counts with its compute: 10 bytes out of layer 2 and 10 into
        // it, at 0.05 s per byte, on top of layer 3's 1.0.
        nodes[1].link_cpu_seconds_per_byte = 0.05;
        let mut sized = shared.clone();
        for c in &mut sized {
            c.out_bytes = 10;
        }
        let p = plan(&sized, &nodes, 0).unwrap();
        assert_eq!(p[1].predicted_seconds, 2.0 + 20.0 * 0.05);
        nodes[1].link_cpu_seconds_per_byte = 0.0;
        // A profile of another model (wrong length) is not used.
        nodes[1].layer_seconds = Some(vec![9.0; 3]);
        nodes[1].speed = 1.0;
        let p = plan(&shared, &nodes, 0).unwrap();
        assert_eq!(bounds(&p), [(0, 2), (2, 4)]);
    }

    #[test]
    fn memory_limits_are_respected_or_reported() {
        let nodes = vec![
            NodeCapacity {
                memory_limit: Some(250),
                ..NodeCapacity::with_speed(1.0)
            };
            3
        ];
        let p = plan(&costs(&[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]), &nodes, 0).unwrap();
        assert!(p.iter().all(|s| s.predicted_bytes <= 250), "{p:?}");
        let tight = vec![
            NodeCapacity {
                memory_limit: Some(150),
                ..NodeCapacity::with_speed(1.0)
            };
            3
        ];
        assert!(matches!(
            plan(&costs(&[1.0; 6]), &tight, 0),
            Err(PlanError::DoesNotFit { .. })
        ));
    }

    /// Under 1F1B stage `s` of `n` holds `min(n − s + 1, M)` micro-batches' stashes: six equal
    /// layers (100 bytes held, 50 a micro-batch in flight) on 4 nodes with M = 8 cost 350 a
    /// layer on stage 0 (5 in flight), 300, 250 and 200 on the others. Limits of 600 fit six
    /// layers only with the first stages light (1, 2, 2, 1 or so); counted at stage 0's window
    /// everywhere, nothing under 700 would fit.
    #[test]
    fn a_1f1b_stage_holds_the_stashes_of_its_place_in_the_ring() {
        let flushed: Vec<LayerCost> = costs(&[1.0; 6])
            .into_iter()
            .map(|c| LayerCost {
                bytes: 100,
                stash_per_in_flight: 50,
                micro_batches: 8,
                ..c
            })
            .collect();
        assert_eq!(
            (0..5)
                .map(|s| flushed[0].bytes_at(s, 4))
                .collect::<Vec<_>>(),
            [350, 300, 250, 200, 150]
        );
        assert_eq!(in_flight_at(0, 4, 2), 2, "never more than M");
        let limited = |limit: u64| {
            vec![
                NodeCapacity {
                    memory_limit: Some(limit),
                    ..NodeCapacity::with_speed(1.0)
                };
                4
            ]
        };
        let p = plan(&flushed, &limited(600), 0).unwrap();
        let bounds: Vec<(usize, usize)> = p.iter().map(|s| (s.start, s.end)).collect();
        assert_eq!(p[0].end - p[0].start, 1, "{bounds:?}");
        for (s, st) in p.iter().enumerate() {
            let layers = (st.end - st.start) as u64;
            assert_eq!(st.predicted_bytes, layers * flushed[0].bytes_at(s, 4));
            assert!(st.predicted_bytes <= 600, "{p:?}");
        }
        // 490: one layer on each of the first three stages, two on the last: five of six.
        assert!(matches!(
            plan(&flushed, &limited(490), 0),
            Err(PlanError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn memory_that_follows_the_ring_size_is_counted_for_the_nodes_used() {
        // Each node of a ring adds 10 bytes a layer (the async window's micro-batch). Counted
        // for all 64 nodes given, a layer would need 740 bytes and nothing would fit 400; the
        // rings that can hold parameters (2..6 nodes) fit, and a plan's figures are for the
        // ring it chose.
        let per_node: Vec<LayerCost> = costs(&[1.0; 6])
            .into_iter()
            .map(|c| LayerCost {
                bytes_per_node: 10,
                ..c
            })
            .collect();
        let limited = |limit: u64| {
            vec![
                NodeCapacity {
                    memory_limit: Some(limit),
                    ..NodeCapacity::with_speed(1.0)
                };
                64
            ]
        };
        let best = plan_best(&per_node, &limited(400), 0, false, None).unwrap();
        let m = best.stages.len();
        assert!((2..=6).contains(&m), "{best:?}");
        for st in &best.stages {
            let layers = (st.end - st.start) as u64;
            assert_eq!(
                st.predicted_bytes,
                layers * (100 + 10 * m as u64),
                "{best:?}"
            );
            assert!(st.predicted_bytes <= 400, "{best:?}");
        }
        // A layer a node needs 160 bytes on six nodes, more on fewer: 150 is refused.
        assert!(matches!(
            plan_best(&per_node, &limited(150), 0, false, None),
            Err(PlanError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn stage_zero_keeps_the_first_parametric_layer() {
        // Layer 0 is a cheap flatten; layer 1 the first linear: stage 0 must not be just layer 0.
        let p = plan(&costs(&[0.0, 5.0, 5.0]), &free(2), 1).unwrap();
        assert_eq!(bounds(&p), [(0, 2), (2, 3)]);
        let spec: StageRanges = "0:1,1:3".parse().unwrap();
        assert!(from_spec(&spec, &costs(&[0.0, 5.0, 5.0]), &free(2), 1).is_err());
    }

    fn layers(seconds: &[f64], out_bytes: &[u64], params: &[bool]) -> Vec<LayerCost> {
        seconds
            .iter()
            .zip(out_bytes)
            .zip(params)
            .map(|((&t, &out), &p)| LayerCost {
                seconds: t,
                bytes: 0,
                bytes_per_node: 0,
                out_bytes: out,
                has_params: p,
                after_send_seconds: 0.0,
                ..Default::default()
            })
            .collect()
    }

    fn carded(n: usize, bytes_per_second: f64, latency: f64) -> Vec<NodeCapacity> {
        vec![
            NodeCapacity {
                card_bytes_per_second: Some(bytes_per_second),
                latency_seconds: latency,
                ..NodeCapacity::with_speed(1.0)
            };
            n
        ]
    }

    /// The link-counting planner, by hand: four layers of 1, 1, 1 and 1.5 ms whose outputs are
    /// 10, 1000, 10 and 10 bytes, on two nodes whose cards send 100,000 bytes/s (1000 bytes:
    /// 10 ms).
    /// Compute alone cuts after layer 2 (2 ms | 2.5 ms). Counting the cards, that cut sends
    /// the wide activation (10 ms + the logits' gradient's 0.1 ms on node 0), while a cut
    /// after layer 3 sends 10 bytes each way: node 0 computes 3 ms and sends 0.2 ms, node 1
    /// computes 1.5 ms and sends 0.2 ms — a bottleneck of 3 ms.
    #[test]
    fn counting_the_links_moves_the_cut_to_the_narrow_activation() {
        let c = layers(&[1e-3, 1e-3, 1e-3, 1.5e-3], &[10, 1000, 10, 10], &[true; 4]);
        assert_eq!(bounds(&plan(&c, &free(2), 0).unwrap()), [(0, 2), (2, 4)]);
        let nodes = carded(2, 1e5, 0.002);
        let p = plan(&c, &nodes, 0).unwrap();
        assert_eq!(bounds(&p), [(0, 3), (3, 4)]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(p[0].predicted_seconds, 3e-3), "{p:?}");
        assert!(close(p[0].predicted_link_seconds, 2e-4), "{p:?}");
        assert!(close(p[1].predicted_seconds, 1.5e-3), "{p:?}");
        assert!(close(p[1].predicted_link_seconds, 2e-4), "{p:?}");
        // Round trip: 4.5 ms of compute, four messages of 10 bytes (0.1 ms each) and four
        // latencies of 2 ms: 12.9 ms; over the 3 ms bottleneck, 5 micro-batches (4.3, and one
        // more for what the model leaves out).
        let best = plan_best(&c, &nodes, 0, false, None).unwrap();
        assert!(close(best.round_trip, 12.9e-3), "{best:?}");
        assert!(close(best.bottleneck, 3e-3), "{best:?}");
        assert_eq!(best.window(), 6);
    }

    /// A stage after the master hands its input gradient back before its weight
    /// gradients and step, so those are off a micro-batch's round trip; the master's own are on
    /// it (its backward ends the trip). The case above with layer 3 (node 1's) running 0.5 of
    /// its 1.5 ms after the send and layer 0 (the master's) 0.4 of its 1 ms: 12.9 − 0.5 =
    /// 12.4 ms. A node with its own figure for layer 3 (3 ms) keeps the layer's share, a third:
    /// 3 + 3 − 1 ms of compute and the same 8.4 ms of links, 13.4 ms.
    #[test]
    fn a_later_stages_weight_gradients_are_off_the_round_trip() {
        let mut c = layers(&[1e-3, 1e-3, 1e-3, 1.5e-3], &[10, 1000, 10, 10], &[true; 4]);
        c[0].after_send_seconds = 0.4e-3;
        c[3].after_send_seconds = 0.5e-3;
        let mut nodes = carded(2, 1e5, 0.002);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        let best = plan_best(&c, &nodes, 0, false, None).unwrap();
        assert_eq!(bounds(&best.stages), [(0, 3), (3, 4)]);
        assert!(close(best.round_trip, 12.4e-3), "{best:?}");
        nodes[1].layer_seconds = Some(vec![1e-3, 1e-3, 1e-3, 3e-3]);
        let stages = plan(&c, &nodes, 0).unwrap();
        assert_eq!(bounds(&stages), [(0, 3), (3, 4)]);
        assert!(close(round_trip(&c, &stages, &nodes), 13.4e-3));
    }

    /// A node holding only a ReLU would relay every activation and gradient for nothing: no
    /// plan gives one, and more nodes than blocks with parameters is refused.
    #[test]
    fn no_stage_only_relays() {
        // linear, relu (heavy, say, on a slow kernel), linear, relu, linear.
        let c = layers(
            &[1.0, 5.0, 1.0, 0.1, 1.0],
            &[1; 5],
            &[true, false, true, false, true],
        );
        let p = plan(&c, &free(3), 0).unwrap();
        for st in &p[1..] {
            assert!(c[st.start..st.end].iter().any(|l| l.has_params), "{p:?}");
        }
        // Without the rule, [linear] [relu] [linear relu linear] would win at 5.
        let slowest = p.iter().map(StagePlan::bottleneck).fold(0.0, f64::max);
        assert!((slowest - 6.0).abs() < 1e-12, "{p:?}");
        assert!(matches!(
            plan(&c, &free(4), 0),
            Err(PlanError::TooManyNodes {
                nodes: 4,
                layers: 3
            })
        ));
    }

    /// On slow cards a third node only adds a card that sends a wide activation both ways:
    /// two nodes train faster, and the plan takes them unless told to use all.
    #[test]
    fn fewer_nodes_are_planned_when_they_train_faster() {
        let c = layers(&[1e-3; 4], &[1000, 1000, 1000, 10], &[true; 4]);
        let nodes = carded(3, 1e5, 0.0);
        let best = plan_best(&c, &nodes, 0, false, None).unwrap();
        assert_eq!(best.stages.len(), 2, "{best:?}");
        // Node 0 sends 1000 + 10 bytes, node 1 10 + 1000: 10.1 ms each.
        assert!((best.bottleneck - 10.1e-3).abs() < 1e-12, "{best:?}");
        assert_eq!(best.by_nodes.len(), 2);
        // With three, the middle node sends 1000 bytes each way: 20 ms.
        let all = plan_best(&c, &nodes, 0, true, None).unwrap();
        assert_eq!(all.stages.len(), 3);
        assert!((all.bottleneck - 20e-3).abs() < 1e-12, "{all:?}");
        // Without cards, every node that can hold parameters (splitting never slows the
        // slowest stage): all three of three, three of five when only three layers have
        // parameters.
        assert_eq!(
            plan_best(&c, &free(3), 0, false, None)
                .unwrap()
                .stages
                .len(),
            3
        );
        let three = layers(&[1e-3; 4], &[1; 4], &[true, false, true, true]);
        assert_eq!(
            plan_best(&three, &free(5), 0, false, None)
                .unwrap()
                .stages
                .len(),
            3
        );
    }

    /// Nodes sharing one machine's cores, by hand: layers of 2, 2, 2 and 0.2 ms whose outputs
    /// are 1000, 1000, 1000 and 10 bytes; links cost 1 µs of CPU a byte (both ends); 2 cores,
    /// 1 thread a node. On their own the nodes would split four ways (2 ms a stage). Sharing
    /// the cores: two nodes cut after layer 2 (4 ms | 2.2 ms of compute) and send 1000 + 10
    /// and 10 + 1000 bytes, 8.22 ms of CPU in all, 4.11 ms on 2 cores; three nodes compute
    /// 6.2 ms and send 4020 bytes, 5.11 ms; four send 6020 bytes, 6.11 ms. Two are planned.
    #[test]
    fn nodes_sharing_cores_are_planned_from_their_summed_cpu() {
        let c = layers(
            &[2e-3, 2e-3, 2e-3, 0.2e-3],
            &[1000, 1000, 1000, 10],
            &[true; 4],
        );
        let alone = plan_best(&c, &free(4), 0, false, None).unwrap();
        assert_eq!(alone.stages.len(), 4, "{alone:?}");
        let shared = SharedCores {
            cores: 2.0,
            threads: 1,
            link_cpu_seconds_per_byte: 1e-6,
        };
        let best = plan_best(&c, &free(4), 0, false, Some(&shared)).unwrap();
        assert_eq!(bounds(&best.stages), [(0, 2), (2, 4)]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(best.bottleneck, 4.11e-3), "{best:?}");
        let expected = [(2, 4.11e-3), (3, 5.11e-3), (4, 6.11e-3)];
        assert_eq!(best.by_nodes.len(), 3);
        for ((m, b), (em, eb)) in best.by_nodes.iter().zip(expected) {
            assert!(*m == em && close(*b, eb), "{:?}", best.by_nodes);
        }
        // Two threads a node double what each stage's compute keeps busy.
        let two = SharedCores {
            threads: 2,
            ..shared
        };
        assert!(close(
            two.pace(&c, &best.stages),
            (2.0 * 6.2e-3 + 2.02e-3) / 2.0
        ));
        // With the cores to spare, the stages' own pace rules and the fewest nodes within 2%
        // of it are taken (four: 2 ms; three: 2.2 ms).
        let many = SharedCores {
            cores: 64.0,
            ..shared
        };
        let spare = plan_best(&c, &free(4), 0, false, Some(&many)).unwrap();
        assert_eq!(spare.stages.len(), 4, "{spare:?}");
        assert!(close(spare.bottleneck, 2e-3), "{spare:?}");
    }

    #[test]
    fn explicit_partitions_are_validated() {
        let c = costs(&[1.0; 5]);
        let spec = |text: &str| text.parse::<StageRanges>();
        assert_eq!(
            bounds(&from_spec(&spec("0:2,2:5").unwrap(), &c, &free(2), 0).unwrap()),
            [(0, 2), (2, 5)]
        );
        // Not ranges that follow one another from layer 0: refused as the flag is read.
        for bad in ["0:2,3:5", "0:2,2:2,2:5", "a:b", "0:2;2:5", "1:5"] {
            assert!(spec(bad).is_err(), "{bad}");
        }
        // Ranges that do not fit this model (5 layers) or these nodes (2).
        for bad in ["0:2,2:4", "0:5", "0:1,1:2,2:5"] {
            assert!(
                from_spec(&spec(bad).unwrap(), &c, &free(2), 0).is_err(),
                "{bad}"
            );
        }
        assert_eq!(spec("0:2,2:5").unwrap().to_string(), "0:2,2:5");
        assert!(matches!(
            plan(&c, &free(6), 0),
            Err(PlanError::TooManyNodes { .. })
        ));
    }

    /// Three linear layers of 1,024 outputs (1 s each, 4 KB out) with a ReLU after each.
    fn three_linears() -> (Vec<LayerCost>, Vec<Option<Cuttable>>) {
        let linear = LayerCost {
            seconds: 1.0,
            bytes: 1000,
            bytes_per_node: 0,
            out_bytes: 4096,
            has_params: true,
            after_send_seconds: 0.5,
            ..Default::default()
        };
        let relu = LayerCost {
            seconds: 0.0,
            bytes: 0,
            bytes_per_node: 0,
            out_bytes: 4096,
            has_params: false,
            after_send_seconds: 0.0,
            ..Default::default()
        };
        let g = Some(Cuttable {
            in_features: 1024,
            out_features: 1024,
        });
        (
            vec![linear, relu, linear, relu, linear, relu],
            vec![g, None, g, None, g, None],
        )
    }

    // The hand-computed case: two nodes and three equal layers; whole layers give 2 s against
    // 1 s, a cut of the middle layer after 512 of its outputs 1.5 s each. The head ends stage
    // 0, the tail starts stage 1, and the first layer (its input is the raw data) is never cut.
    #[test]
    fn a_cut_inside_the_middle_layer_balances_two_stages() {
        let (costs, geometry) = three_linears();
        let nodes = free(2);
        let whole = plan_best(&costs, &nodes, 0, true, None).unwrap();
        assert!((whole.bottleneck - 2.0).abs() < 1e-9);
        let refined = cut_inside(&costs, &geometry, &nodes, &whole, 0, None).unwrap();
        assert_eq!(
            refined.cuts,
            [CutInside {
                layer: 2,
                split: 512
            }]
        );
        assert!((refined.plan.bottleneck - 1.5).abs() < 1e-9, "{refined:?}");
        assert_eq!(bounds(&refined.plan.stages), [(0, 3), (3, 7)]);
        assert_eq!(refined.costs.len(), costs.len() + 1);
        // The head's share of the layer, and what the cut sends: the layer's input and the
        // head's outputs.
        let (head, tail) = (refined.costs[2], refined.costs[3]);
        assert!((head.seconds - 0.5).abs() < 1e-12 && (tail.seconds - 0.5).abs() < 1e-12);
        assert!((head.after_send_seconds - 0.25).abs() < 1e-12);
        assert_eq!(head.out_bytes, 4096 + 2048);
        assert_eq!(tail.out_bytes, 4096);
        assert_eq!(head.bytes + tail.bytes, 1000);
    }

    // A model whose largest layers no node can hold whole (wide-mlp's shape: 38, 201, 201 and
    // 1 units of memory, nodes of 112, 167, 167 and 167): whole layers cannot fit, cutting the
    // two large layers does, with every node within its limit's fill margin. Filling each node
    // to the brim would leave the second large layer's tail too large for the third node: the
    // search takes the other choice there.
    #[test]
    fn layers_too_large_for_any_node_are_cut_to_fit_the_memory() {
        let layer = |bytes: u64| LayerCost {
            seconds: bytes as f64 * 1e-3,
            bytes,
            bytes_per_node: 0,
            out_bytes: 64,
            has_params: true,
            after_send_seconds: 0.0,
            ..Default::default()
        };
        let costs = vec![layer(38), layer(201), layer(201), layer(1)];
        let cuttable = Some(Cuttable {
            in_features: 4096,
            out_features: 4096,
        });
        let geometry = vec![cuttable, cuttable, cuttable, None];
        let mut nodes = free(4);
        for (node, limit) in nodes.iter_mut().zip([112, 167, 167, 167]) {
            node.memory_limit = Some(limit);
        }
        assert!(matches!(
            plan_best(&costs, &nodes, 0, true, None),
            Err(PlanError::DoesNotFit { .. })
        ));
        let fitted = fit_by_cutting(&costs, &geometry, &nodes, 0, None).unwrap();
        assert_eq!(
            fitted.cuts.iter().map(|c| c.layer).collect::<Vec<_>>(),
            [1, 2]
        );
        for (stage, node) in fitted.plan.stages.iter().zip(&nodes) {
            let limit = node.memory_limit.unwrap() as f64;
            assert!(
                stage.predicted_bytes as f64 <= limit * FILL_MARGIN,
                "{stage:?} over {limit}"
            );
        }
        let held: u64 = fitted.plan.stages.iter().map(|s| s.predicted_bytes).sum();
        assert!((439..=441).contains(&held), "{held}");
        // The first layer is the master's first with parameters: never cut there.
        let e = fit_by_cutting(
            &[layer(300), layer(1)],
            &[cuttable, None],
            &nodes[..2],
            0,
            None,
        );
        assert!(e.is_none());
    }

    // The node count is chosen after the cuts: three equal layers, the last not cuttable, on
    // three nodes of which the third runs at 2/3 speed, links counted (cards too fast to
    // matter). Whole layers: 2 s on 2 nodes, 1.5 s on 3 (the slow node's layer; no cut helps
    // there) — 3 nodes. With a cut of the middle layer after 512, 2 nodes also make 1.5 s: the
    // fewest within 2% of the best, as `plan_best` chooses, is 2 nodes with the cut.
    #[test]
    fn the_node_count_is_chosen_with_the_cuts() {
        let (costs, mut geometry) = three_linears();
        geometry[4] = None;
        let mut nodes = carded(3, 1e15, 0.0);
        nodes[2].speed = 2.0 / 3.0;
        let whole = plan_best(&costs, &nodes, 0, false, None).unwrap();
        assert_eq!(whole.stages.len(), 3, "{whole:?}");
        assert!((whole.bottleneck - 1.5).abs() < 1e-6);
        assert!(cut_inside(&costs, &geometry, &nodes, &whole, 0, None).is_none());
        let refined = plan_best_cut(&costs, &geometry, &nodes, &whole, 0, None).unwrap();
        assert_eq!(refined.plan.stages.len(), 2, "{refined:?}");
        assert_eq!(
            refined.cuts,
            [CutInside {
                layer: 2,
                split: 512
            }]
        );
        let by: Vec<(usize, f64)> = refined.plan.by_nodes.clone();
        assert_eq!(by.len(), 2);
        assert!(by.iter().all(|(_, b)| (b - 1.5).abs() < 1e-6), "{by:?}");
        // Counting compute alone, the most nodes within 2% are used: 3, whole — `None`.
        let free_nodes = {
            let mut n = free(3);
            n[2].speed = 2.0 / 3.0;
            n
        };
        let whole = plan_best(&costs, &free_nodes, 0, false, None).unwrap();
        assert!(plan_best_cut(&costs, &geometry, &free_nodes, &whole, 0, None).is_none());
    }

    // A cut that would not lower the bottleneck by 1% is not made; a node's own per-layer
    // figures are cut with the shared ones; and on slow links the larger boundary weighs in.
    #[test]
    fn a_cut_is_made_only_where_it_lowers_the_bottleneck_links_counted() {
        let (costs, geometry) = three_linears();
        // Three nodes: one layer each, already balanced.
        let nodes = free(3);
        let whole = plan_best(&costs, &nodes, 0, true, None).unwrap();
        assert!(cut_inside(&costs, &geometry, &nodes, &whole, 0, None).is_none());
        // Node 0 runs a layer in 0.4 s (its own figures), node 1 in 1 s: whole layers give
        // [L0 L2 | L4], 0.8 against 1 s; the head of L4 moves to node 0. After 128 of its
        // outputs: 0.8 + 0.05 against 0.875 s (192 ties at 0.875, 64 gives 0.94).
        let mut own = free(2);
        own[0].layer_seconds = Some(costs.iter().map(|c| c.seconds * 0.4).collect());
        let whole = plan_best(&costs, &own, 0, true, None).unwrap();
        assert!((whole.bottleneck - 1.0).abs() < 1e-9);
        let r = cut_inside(&costs, &geometry, &own, &whole, 0, None).unwrap();
        assert_eq!(
            r.cuts,
            [CutInside {
                layer: 4,
                split: 128
            }]
        );
        assert!((r.plan.bottleneck - 0.875).abs() < 1e-9, "{r:?}");
        assert!(
            (r.plan.stages[0].predicted_seconds - 0.85).abs() < 1e-9,
            "{r:?}"
        );
        assert_eq!(bounds(&r.plan.stages), [(0, 5), (5, 7)]);
        // Cards of 5 KB/s: the whole-layer cut sends 4 KB each way (1.64 s of card against 2 s
        // of compute). Cutting L2 after s outputs sends 4 s more bytes: 512 (compute 1.5 s a
        // stage) would take 2.05 s of card; 192 gives 1.81 s of compute against 1.79 of card.
        let mut slow = free(2);
        for n in &mut slow {
            n.card_bytes_per_second = Some(5_000.0);
        }
        let whole = plan_best(&costs, &slow, 0, true, None).unwrap();
        assert!((whole.bottleneck - 2.0).abs() < 1e-9);
        let r = cut_inside(&costs, &geometry, &slow, &whole, 0, None).unwrap();
        assert_eq!(
            r.cuts,
            [CutInside {
                layer: 2,
                split: 192
            }]
        );
        assert!((r.plan.bottleneck - 1.8125).abs() < 1e-9, "{r:?}");
    }
}
