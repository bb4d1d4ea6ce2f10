//! What each node of a ring offers the planner: its speed, the memory its stage may use (its
//! limit less what its process needs besides the stage), its card and latency, and — where it
//! sent one — its own profile of the model's layers; and, for nodes that share one machine, what
//! their links cost those cores.

use ringtmp_data::Dataset;

use crate::plan::partition::{LayerCost, NodeCapacity, SharedCores};
use ringtmp_contract::contract::{Cluster, PlanReport, SharedMachine, show_bytes};
use ringtmp_contract::error::{Error, Result};

/// Each node of the first ring's capacity, from the cluster: speeds, the memory its stage may use,
/// its card. Every ring is split the same way, planned from the first ring's nodes.
#[allow(clippy::type_complexity)]
pub(super) fn capacities(
    cluster: &Cluster,
    nodes: u32,
    data: &Dataset,
    layers: &[ringtmp_model::Layer],
) -> Result<(Vec<f64>, Vec<Option<u64>>, Vec<NodeCapacity>)> {
    let speeds: Vec<f64> = cluster
        .node_speeds
        .iter()
        .take(nodes as usize)
        .copied()
        .collect();

    // A limit is the whole process's (a board's memory, or --enforce-memory-limit's cgroup):
    // the stage gets what the process itself and, on the master, the dataset leave of it.
    let limits: Vec<Option<u64>> = cluster
        .memory_limits
        .iter()
        .take(nodes as usize)
        .enumerate()
        .map(|(rank, limit)| {
            let Some(limit) = *limit else { return Ok(None) };
            let needs = process_overhead(rank == 0, data, layers);
            if needs >= limit {
                return Err(Error::Config(format!(
                    "--node-memory-limit: node {rank}'s {} leaves nothing for its stage: the \
                     process itself needs about {} (runtime, buffers, GEMM workspace{})",
                    show_bytes(limit),
                    show_bytes(needs),
                    if rank == 0 {
                        ", and the dataset the master holds"
                    } else {
                        ""
                    }
                )));
            }
            Ok(Some(limit - needs))
        })
        .collect::<Result<_>>()?;
    let capacities: Vec<NodeCapacity> = speeds
        .iter()
        .zip(&limits)
        .enumerate()
        .map(|(rank, (&speed, &memory_limit))| {
            let (mbit, ms) = cluster.links.get(rank).copied().unwrap_or((None, 0.0));
            NodeCapacity {
                speed,
                memory_limit,
                card_bytes_per_second: mbit.map(|m| m * 1e6 / 8.0),
                latency_seconds: ms / 1e3,
                layer_seconds: None,
                link_cpu_seconds_per_byte: 0.0,
            }
        })
        .collect();
    Ok((speeds, limits, capacities))
}

/// What a node's own profile must match to be used, and what its figures are compared with.
pub(super) struct OwnProfileCheck<'a, F: Fn(u32) -> u64> {
    pub rows: usize,
    pub threads: usize,
    pub steps_per_micro_batch: f64,
    /// Rank 0's profile of the same layers.
    pub costs: &'a [LayerCost],
    /// The process overhead of a rank (taken from its free memory).
    pub overhead: F,
}

/// Puts every node's own profile into its capacity: its seconds per layer, and its
/// free memory (less its process overhead) as a memory limit where that is tighter than the
/// given one; reports each node's measured speed relative to rank 0 on this model. A profile of
/// other rows, threads or layers is set aside with a warning (the node is then planned from
/// rank 0's profile and its `--node-speed`).
pub(super) fn use_own_profiles<F: Fn(u32) -> u64>(
    cluster: &Cluster,
    capacities: &mut [NodeCapacity],
    check: &OwnProfileCheck<'_, F>,
    report: &mut PlanReport,
) {
    if cluster.node_profiles.iter().all(Option::is_none) {
        return;
    }
    let reference: f64 = check.costs.iter().map(|c| c.seconds).sum();
    report.note(format!(
        "nodes' own profiles (seconds per micro-batch of {} rows, the whole model, {} \
         thread(s)):",
        check.rows, check.threads
    ));
    report.note(format!(
        "  node 0: {:.2} ms — {} (rank 0, plans)",
        reference * 1e3,
        crate::plan::node_profile::machine_description()
    ));
    for (rank, capacity) in capacities.iter_mut().enumerate().skip(1) {
        let Some(Some(profile)) = cluster.node_profiles.get(rank) else {
            report.note(format!(
                "  node {rank}: no profile of its own: planned from rank 0's"
            ));
            continue;
        };
        if profile.rows != check.rows
            || profile.threads != check.threads
            || profile.layers.len() != check.costs.len()
        {
            report.note(format!(
                "  node {rank}: its profile ({} rows, {} threads, {} layers) is not of this plan's \
                 micro-batch ({} rows, {} threads, {} layers): planned from rank 0's",
                profile.rows,
                profile.threads,
                profile.layers.len(),
                check.rows,
                check.threads,
                check.costs.len()
            ));
            continue;
        }
        let own = profile.seconds(check.steps_per_micro_batch);
        let total: f64 = own.iter().sum();
        let free = profile
            .available_memory
            .map(|m| m.saturating_sub((check.overhead)(rank as u32)));
        if let Some(free) = free {
            capacity.memory_limit = Some(capacity.memory_limit.map_or(free, |m| m.min(free)));
        }
        // The node's own card (its command line's), where the run's options name none for it.
        let mut card = String::new();
        if capacity.card_bytes_per_second.is_none()
            && let Some(mbit) = profile.card_mbit.filter(|m| m.is_finite() && *m > 0.0)
        {
            capacity.card_bytes_per_second = Some(mbit * 1e6 / 8.0);
            card = format!(", its card {mbit} Mbit/s");
        }
        if capacity.latency_seconds == 0.0 && profile.latency_ms.is_finite() {
            capacity.latency_seconds = profile.latency_ms.max(0.0) / 1e3;
        }
        // Its links' CPU work takes from its compute where no core is left over for it.
        let mut link = String::new();
        if let Some(per_byte) = profile.link_seconds_per_byte.filter(|s| s.is_finite()) {
            let counted = profile.cores <= check.threads;
            if counted {
                capacity.link_cpu_seconds_per_byte = per_byte.max(0.0);
            }
            link = format!(
                ", its links {:.2} ms of CPU per MB{}",
                per_byte * 1e9,
                if counted {
                    " (counted: no core to spare)"
                } else {
                    ""
                }
            );
        }
        let ratio = reference / total.max(1e-12);
        let speed = if ratio >= 0.095 {
            format!("{ratio:.2}× rank 0's speed")
        } else {
            format!("1/{:.0} of rank 0's speed", 1.0 / ratio.max(1e-12))
        };
        report.note(format!(
            "  node {rank}: {:.2} ms, {speed} — {}{card}{link}{}{}",
            total * 1e3,
            profile.machine,
            profile
                .available_memory
                .map_or(String::new(), |m| format!(", {} free", show_bytes(m))),
            if profile.cached {
                ", from its cache".to_string()
            } else {
                format!(", measured in {:.1} s", profile.took_seconds)
            }
        ));
        capacity.layer_seconds = Some(own);
    }
}

/// The bound of nodes that share `machine`'s cores: what a link costs the CPU per byte is
/// measured here, on frames of the widest activation a cut can send (as every node measures its
/// own at rendezvous, `node_profile`), in about a tenth of a second.
pub(super) fn shared_cores(
    machine: SharedMachine,
    costs: &[LayerCost],
    threads: usize,
) -> SharedCores {
    let frame = costs
        .iter()
        .map(|c| c.out_bytes)
        .max()
        .unwrap_or(4)
        .clamp(4, 4 << 20) as usize;
    let budget = std::time::Duration::from_millis(100);
    let per_byte = match ringtmp_transport::link_cost::seconds_per_byte(
        machine.private_links,
        frame,
        budget,
    ) {
        Ok(s) if s.is_finite() => s.max(0.0),
        Ok(s) => {
            tracing::warn!("the links' CPU cost measured {s} s per byte; not counted");
            0.0
        }
        Err(e) => {
            tracing::warn!("could not time the links' CPU cost ({e}); not counted");
            0.0
        }
    };
    SharedCores {
        cores: machine.cores.max(1) as f64,
        threads,
        link_cpu_seconds_per_byte: per_byte,
    }
}

pub use ringtmp_contract::memory_floor::PROCESS_BASELINE_BYTES;

/// Memory a node's process needs beyond its stage: the baseline; the matrix multiplications'
/// packing workspace, which peaks at about one copy of the largest weight matrix (wide-mlp's
/// nodes holding a 4096 × 4096 layer peak 62–68 MiB above their stage's 192 MiB); and on the
/// master the dataset (pixels as bytes and labels, train and test, as the data crate keeps them).
/// The workspace is counted for the model's largest matrix on every node: an upper bound.
pub fn process_overhead(master: bool, data: &Dataset, layers: &[ringtmp_model::Layer]) -> u64 {
    let workspace = layers
        .iter()
        .filter(|l| l.param_count() > 0)
        .map(|l| l.param_count() as u64 * 4)
        .max()
        .unwrap_or(0);
    let dataset = if master {
        let (h, w, c) = data.input;
        match data.task {
            // The token ids (u32), train and validation; the examples are windows over them.
            ringtmp_data::Task::NextToken { seq_len, .. } => {
                (data.train.len() + seq_len + data.test.len() * seq_len) as u64 * 4
            }
            ringtmp_data::Task::Classify | ringtmp_data::Task::Regress => {
                (data.train.len() + data.test.len()) as u64 * (h * w * c + 1) as u64
            }
        }
    } else {
        0
    };
    PROCESS_BASELINE_BYTES + workspace + dataset
}

/// Most bytes a node's evaluation may take (its largest layer's input, output and side data for
/// a pass, and the passes' messages it may have queued): 64 MiB, or a sixteenth of the smallest
/// memory limit where that is less (a board of 256 MiB gives it 16).
const EVAL_BUDGET: u64 = 64 << 20;

/// How the ring evaluates: rows per pass around the ring, and the memory a node needs for it
/// besides its stage (held between evaluations too: the buffers are kept for the next one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvalPlan {
    /// Windows or images per pass.
    pub rows: usize,
    /// The largest layer's working set for a pass, and the passes' messages a node may have
    /// queued ([`crate::run::master::EVAL_CHUNKS_IN_FLIGHT`] of them).
    pub bytes: u64,
}

/// The evaluation passes for layers of `costs` (measured on micro-batches of `rows`) on nodes
/// whose smallest memory limit is `smallest_limit`: the evaluation's usual passes
/// (`default_rows`), fewer rows where they would outgrow [`EVAL_BUDGET`] (a transformer block
/// of `gpt-100m` holds ~14 MB a window).
pub fn eval_plan(
    costs: &[LayerCost],
    rows: usize,
    default_rows: usize,
    smallest_limit: Option<u64>,
) -> EvalPlan {
    let rows = rows.max(1) as u64;
    let per_row = |f: fn(&LayerCost) -> u64| costs.iter().map(f).max().unwrap_or(0).div_ceil(rows);
    let queued = crate::run::master::EVAL_CHUNKS_IN_FLIGHT as u64;
    let row_bytes = per_row(|c| c.eval_bytes) + queued * per_row(|c| c.out_bytes);
    let budget = smallest_limit.map_or(EVAL_BUDGET, |l| EVAL_BUDGET.min(l / 16));
    let fitting = (budget / row_bytes.max(1)).max(1);
    let eval_rows = (default_rows as u64).min(fitting).max(1);
    EvalPlan {
        rows: eval_rows as usize,
        bytes: eval_rows * row_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer whose evaluation holds 14 MB a window (a `gpt-100m` block's, measured on
    /// micro-batches of 2 windows) evaluates 3 windows a pass, not the usual 7, and one on a
    /// small node; a small model keeps the usual passes. The bytes count the pass's working set
    /// and 8 passes' messages.
    #[test]
    fn evaluation_passes_shrink_to_the_working_set_budget() {
        let layer = |eval_bytes: u64, out_bytes: u64| LayerCost {
            eval_bytes,
            out_bytes,
            ..Default::default()
        };
        let big = [layer(2_000_000, 1_000), layer(28_000_000, 1_572_864)];
        let plan = eval_plan(&big, 2, 7, None);
        assert_eq!(plan.rows, 3);
        assert_eq!(plan.bytes, 3 * (14_000_000 + 8 * 786_432));
        assert_eq!(eval_plan(&big, 2, 7, Some(256 << 20)).rows, 1);
        let small = [layer(100_000, 10_000)];
        assert_eq!(eval_plan(&small, 2, 7, None).rows, 7);
        let huge = [layer(1 << 40, 0)];
        assert_eq!(eval_plan(&huge, 1, 7, None).rows, 1, "at least one");
    }
}
