//! The partition the ring runs: the layers split into contiguous stages, one per node — the
//! user's (`--partition`) or the planner's best for the measured costs and the nodes'
//! capacities, with fewer nodes where more would not train faster — and, where whole layers
//! cannot balance the stages, a cut inside a linear layer (`--cut-inside`).

use ringtmp_model::{Layer, LayerKind};

use super::CutInsideChoice;
use super::RingOptions;
use crate::plan::partition::{self, CutInside, LayerCost, NodeCapacity, SharedCores};
use crate::run::schedule::Schedule;
use ringtmp_contract::contract::{PlanReport, SharedMachine};
use ringtmp_contract::error::{Error, Result};

/// The partition chosen, and what the rest of the plan reads from the choice.
pub(super) struct Chosen {
    /// The stages, their predicted bottleneck and round trip, and the bottleneck by node count.
    pub planned: partition::Plan,
    /// Linear layers cut in two, in layer order.
    pub cuts_inside: Vec<CutInside>,
    /// The costs of the layers the nodes share (before the head), with the cuts made.
    pub body: Vec<LayerCost>,
    /// Where the head the master keeps starts (the model's length without one).
    pub head_start: usize,
    /// The bound of nodes that share one machine's cores.
    pub shared: Option<SharedCores>,
    /// Whether the links were counted at each node's card.
    pub links_counted: bool,
}

/// Chooses the partition of `layers` (whose costs are `costs`) over the nodes' `capacities`.
#[expect(
    clippy::too_many_lines,
    reason = "the planner's choices in order, each noted in the report"
)]
pub(super) fn choose(
    args: &RingOptions,
    layers: &[Layer],
    costs: &[LayerCost],
    capacities: &[NodeCapacity],
    shared_machine: Option<SharedMachine>,
    threads: usize,
    schedule: Schedule,
    replicas: usize,
    first_param: usize,
    report: &mut PlanReport,
) -> Result<Chosen> {
    // With the head on the master, the last layer with parameters (and what follows it) stays
    // there; the nodes share the rest.
    let head_start = if args.master_holds_head.unwrap_or(false) {
        let last_param = layers
            .iter()
            .rposition(|l| l.param_count() > 0)
            .unwrap_or(0);
        if last_param <= first_param {
            return Err(Error::Config(
                "--master-holds-head needs at least two layers with parameters".into(),
            ));
        }
        last_param
    } else {
        layers.len()
    };
    if layers.iter().any(|l| l.tied_to.is_some()) {
        if head_start == layers.len() {
            return Err(Error::Config(
                "the model ties its head to its token embedding (tie_embeddings): on the ring \
                 the embedding is the master's and the head the last node's, and one matrix \
                 cannot be updated on two nodes; add --master-holds-head (the master then \
                 holds both), or untie the model"
                    .into(),
            ));
        }
        report.note(
            "weights: the head is tied to the token embedding; the master holds both and \
             updates their one matrix from the sum of both gradients",
        );
    }
    let body = &costs[..head_start];
    // Fewer nodes than given only for one plain ring: rings of rings are laid out by --nodes,
    // and stage replicas heal among all of them.
    let may_use_fewer =
        replicas == 1 && args.stage_replicas.is_none() && !args.use_all_nodes.unwrap_or(false);
    let links_counted = capacities.iter().any(|c| c.card_bytes_per_second.is_some());
    let shared =
        shared_machine.map(|machine| super::capacity::shared_cores(machine, body, threads));
    // Finer cuts than whole layers where they balance the stages better (docs/decisions/edge-emulation.md).
    let choice = args
        .cut_inside
        .clone()
        .unwrap_or(CutInsideChoice::Planner(true));
    // A given partition places whole layers where the user said.
    let not_with = args.partition.is_some().then_some("--partition");
    let geometry: Vec<Option<partition::Cuttable>> = layers[..head_start]
        .iter()
        .map(|l| match &l.kind {
            // A linear layer over a sequence runs on every position: not cut inside.
            LayerKind::Linear(linear) if l.input.as_flat().is_some() && linear.bias => {
                Some(partition::Cuttable {
                    in_features: linear.in_features,
                    out_features: linear.out_features,
                })
            }
            _ => None,
        })
        .collect();
    let planned = match &args.partition {
        Some(spec) => partition::from_spec(spec, body, capacities, first_param).map(|stages| {
            let bottleneck = stages
                .iter()
                .map(|s| s.bottleneck())
                .fold(0.0, f64::max)
                .max(shared.map_or(0.0, |c| c.pace(body, &stages)));
            let round_trip = partition::round_trip(body, &stages, capacities);
            partition::Plan {
                by_nodes: vec![(stages.len(), bottleneck)],
                stages,
                bottleneck,
                round_trip,
            }
        }),
        None => partition::plan_best(
            body,
            capacities,
            first_param,
            !may_use_fewer,
            shared.as_ref(),
        ),
    };
    // No partition of whole layers fits the memory: cut the layers that overflow a node, where
    // cuts inside layers are the planner's to make.
    let planned = match planned {
        Err(partition::PlanError::DoesNotFit { .. })
            if not_with.is_none() && matches!(choice, CutInsideChoice::Planner(true)) =>
        {
            match partition::fit_by_cutting(
                body,
                &geometry,
                capacities,
                first_param,
                shared.as_ref(),
            ) {
                Some(fitted) => {
                    for cut in &fitted.cuts {
                        let g = geometry[cut.layer].expect("only linear layers are cut");
                        report.note(format!(
                            "cut inside layer {} (linear {}→{}) after {} of its outputs: no \
                             partition of whole layers fits the nodes' memory limits",
                            cut.layer, g.in_features, g.out_features, cut.split
                        ));
                    }
                    return Ok(Chosen {
                        planned: fitted.plan,
                        cuts_inside: fitted.cuts,
                        body: fitted.costs,
                        head_start,
                        shared,
                        links_counted,
                    });
                }
                None => planned,
            }
        }
        other => other,
    }
    .map_err(|e| match (&e, schedule) {
        (partition::PlanError::DoesNotFit { .. }, Schedule::Async) => Error::Config(format!(
            "{e}; the async schedule stashes a version of each stage's weights per micro-batch \
             in flight{}: --schedule 1f1b needs none",
            match args.in_flight {
                Some(w) => format!(" ({w}, and two spare)"),
                None => " (one per node and one more, and two spare)".to_string(),
            }
        )),
        _ => Error::Config(e.to_string()),
    })?;
    // A restart's kept cuts are made as given ones are, boundaries where they fit.
    let (choice, kept) = match choice {
        CutInsideChoice::Kept(cuts) => (CutInsideChoice::At(cuts), true),
        other => (other, false),
    };
    let (planned, cuts_inside, body) = match (choice, not_with) {
        (CutInsideChoice::At(cuts), Some(flag)) if !cuts.is_empty() => {
            return Err(Error::Config(format!(
                "--cut-inside {}: cuts inside layers do not go with {flag} yet",
                CutInsideChoice::At(cuts)
            )));
        }
        (CutInsideChoice::At(cuts), None) if !cuts.is_empty() => plan_given_cuts(
            cuts,
            kept,
            layers,
            first_param,
            head_start,
            body,
            &geometry,
            capacities,
            may_use_fewer,
            shared.as_ref(),
        )?,
        (CutInsideChoice::Planner(true), None) => refine_with_cut(
            planned,
            body,
            &geometry,
            capacities,
            first_param,
            shared.as_ref(),
            report,
        ),
        _ => (planned, Vec::new(), body.to_vec()),
    };
    Ok(Chosen {
        planned,
        cuts_inside,
        body,
        head_start,
        shared,
        links_counted,
    })
}

/// The async window: enough micro-batches in flight to cover one's round trip at the slowest
/// stage's pace, as far as the memory limits allow (the plan counted one per node and one more).
/// `body` is the nodes' layers' costs, `head` the costs of the head the master keeps where
/// `holds_head`.
pub(super) fn async_window(
    planned: &partition::Plan,
    limits: &[Option<u64>],
    body: &[LayerCost],
    head: &[LayerCost],
    holds_head: bool,
    report: &mut PlanReport,
) -> usize {
    let used = planned.stages.len() as u32;
    let window = planned.window();
    let fitting = planned
        .stages
        .iter()
        .filter_map(|st| {
            let limit = limits[st.rank as usize]?;
            let on_node = |costs: &[LayerCost]| -> (u64, u64) {
                costs.iter().fold((0, 0), |(b, p), c| {
                    (b + c.bytes_in_ring(used as usize), p + c.bytes_per_node)
                })
            };
            let (mut bytes, mut per_micro_batch) = on_node(&body[st.start..st.end]);
            if st.rank == 0 && holds_head {
                let (b, p) = on_node(head);
                bytes += b;
                per_micro_batch += p;
            }
            let spare = limit.saturating_sub(bytes);
            Some((used as usize + 1).saturating_add((spare / per_micro_batch.max(1)) as usize))
        })
        .min()
        .unwrap_or(usize::MAX);
    let capped = window.min(fitting);
    if capped < window {
        report.note(format!(
            "async window: {window} micro-batches would cover the round trip, kept at \
             {capped} for the memory limits (--in-flight sets it)"
        ));
    }
    let covering = window - 1;
    if covering > used as usize && capped == window {
        report.note(format!(
            "async window: {capped} micro-batches in flight: a micro-batch's predicted \
             round trip of {:.2} ms spans {covering} of the slowest stage's {:.2} ms \
             turns, and one more for what the prediction leaves out; gradients up to {} \
             mini-batches stale (--in-flight sets it)",
            planned.round_trip * 1e3,
            planned.bottleneck * 1e3,
            capped - 1
        ));
    } else if capped > used as usize {
        report.note(format!(
            "async window: {capped} micro-batches in flight (one per node and one more): \
             gradients up to {} mini-batches stale (--in-flight sets it)",
            capped - 1
        ));
    }
    capped
}

/// Says why the plan leaves nodes idle: more would have a node without parameters, or would not
/// train faster.
pub(super) fn note_idle_nodes(
    planned: &partition::Plan,
    shared: Option<&SharedCores>,
    nodes: u32,
    report: &mut PlanReport,
) {
    let used = planned.stages.len() as u32;
    let idle_nodes = nodes - used;
    let by: Vec<String> = planned
        .by_nodes
        .iter()
        .map(|(m, b)| format!("{m}: {:.2} ms", b * 1e3))
        .collect();
    let most = planned.by_nodes.iter().map(|(m, _)| *m).max().unwrap_or(0);
    let why = if most < nodes as usize {
        format!("more than {most} would have a node without parameters, which only relays")
    } else if let Some(shared) = shared {
        format!(
            "more would not train faster (within 2%) on the {} they share, where every \
             further node adds link work",
            shared.cores_named()
        )
    } else {
        "more would not train faster (within 2%)".to_string()
    };
    report.note(format!(
        "the plan uses {used} of the {nodes} nodes: {why} (the slowest stage per \
         micro-batch with {}; --use-all-nodes insists on all); {} idle",
        by.join(", "),
        if idle_nodes == 1 {
            format!("node {used} stays")
        } else {
            format!("nodes {used}..{} stay", nodes - 1)
        }
    ));
}

/// The partition as the plan reports it: the schedule, how the links were counted, and each
/// node's layers with their predicted compute, link time and memory.
pub(super) fn note_partition(
    plan: &[partition::StagePlan],
    staged_layers: &[Layer],
    body: &[LayerCost],
    head: Option<&partition::StagePlan>,
    schedule: Schedule,
    micro_batches: usize,
    links_counted: bool,
    shared: Option<&SharedCores>,
    report: &mut PlanReport,
) {
    let used = plan.len();
    if let Some(h) = head {
        report.note(format!(
            "  node 0 also holds the head: layers {}..{} (the logits never leave it)",
            h.start, h.end
        ));
    }
    report.note(format!(
        "partition ({} nodes, {} schedule, {micro_batches} micro-batch{}; {}):",
        used,
        schedule.name(),
        if micro_batches == 1 { "" } else { "es" },
        match (links_counted, shared) {
            (true, _) => "links counted at each node's card".to_string(),
            (false, Some(shared)) => format!(
                "the nodes share this machine's {}: each stage's compute and its links' CPU \
                 ({:.2} ms per MB, both ends) count against them, {:.2} ms per micro-batch in \
                 all; no bandwidth given (--bandwidth-mbit or --link)",
                shared.cores_named(),
                shared.link_cpu_seconds_per_byte * 1e9,
                shared.pace(body, plan) * 1e3
            ),
            (false, None) => {
                "links not counted: no bandwidth given (--bandwidth-mbit or --link)".to_string()
            }
        }
    ));
    for (i, s) in plan.iter().enumerate() {
        let kinds: Vec<&str> = staged_layers[s.start..s.end]
            .iter()
            .map(|l| l.kind_name())
            .collect();
        let card = if links_counted {
            format!(", its card {:.2} ms", s.predicted_link_seconds * 1e3)
        } else {
            String::new()
        };
        let link = match shared {
            Some(shared) => format!(
                "{card}, its links {:.2} ms of CPU",
                shared.link_seconds(body, i, s) * 1e3
            ),
            None => card,
        };
        report.note(format!(
            "  node {}: layers {}..{} [{}], predicted {:.2} ms of compute per micro-batch{link}, \
             {:.1} MB",
            s.rank,
            s.start,
            s.end,
            kinds.join(" "),
            s.predicted_seconds * 1e3,
            s.predicted_bytes as f64 / 1e6
        ));
    }
}

/// The partition around the user's cuts inside layers (`--cut-inside LAYER:SPLIT,…`, or a
/// restart's `kept` cuts, which make boundaries only where they fit).
fn plan_given_cuts(
    cuts: Vec<CutInside>,
    kept: bool,
    layers: &[Layer],
    first_param: usize,
    head_start: usize,
    body: &[LayerCost],
    geometry: &[Option<partition::Cuttable>],
    capacities: &[NodeCapacity],
    may_use_fewer: bool,
    shared: Option<&SharedCores>,
) -> Result<(partition::Plan, Vec<CutInside>, Vec<LayerCost>)> {
    check_given_cuts(&cuts, layers, first_param, head_start)?;
    let fit = cuts.len() < capacities.len();
    if !fit && !kept {
        return Err(Error::Config(format!(
            "--cut-inside {}: {} cut(s) need {} stages, one more than the cuts, and the \
             ring has {} node(s)",
            CutInsideChoice::At(cuts.clone()),
            cuts.len(),
            cuts.len() + 1,
            capacities.len()
        )));
    }
    let (work, caps) = partition::apply_cuts(body, geometry, capacities, &cuts);
    let mut sorted = cuts;
    sorted.sort_by_key(|c| c.layer);
    // Each head ends a stage and its tail starts the next: in the cut layers' positions,
    // after the k-th cut's head (the k cuts before it each add a layer).
    let bounds: Vec<usize> = sorted
        .iter()
        .enumerate()
        .filter(|_| fit)
        .map(|(k, cut)| cut.layer + k + 1)
        .collect();
    // No linear layer comes before the first with parameters, so no cut shifts it.
    let planned =
        partition::plan_best_around(&work, &caps, first_param, !may_use_fewer, shared, &bounds)
            .map_err(|e| Error::Config(e.to_string()))?;
    Ok((planned, sorted, work))
}

/// Refuses a cut the ring cannot make: inside the first layer with parameters (its input, the
/// raw data, would leave the master), inside the head the master keeps, twice in one layer, or
/// in a layer that is not linear or with a part left empty.
fn check_given_cuts(
    cuts: &[CutInside],
    layers: &[Layer],
    first_param: usize,
    head_start: usize,
) -> Result<()> {
    for cut in cuts {
        if cut.layer == first_param {
            return Err(Error::Config(format!(
                "--cut-inside {}:{}: layer {} is the first with parameters, whose input \
             (the raw data) a cut would send to the next node",
                cut.layer, cut.split, cut.layer
            )));
        }
        if cut.layer >= head_start && cut.layer < layers.len() {
            return Err(Error::Config(format!(
                "--cut-inside {}:{}: layer {} is in the head the master holds \
             (--master-holds-head: layers {head_start}..{})",
                cut.layer,
                cut.split,
                cut.layer,
                layers.len()
            )));
        }
        if cuts.iter().filter(|c| c.layer == cut.layer).count() > 1 {
            return Err(Error::Config(format!(
                "--cut-inside: layer {} is cut twice",
                cut.layer
            )));
        }
        // Names the layer and what is wrong (not linear, a part left empty).
        ringtmp_model::layers::cut_linear(&layers[..head_start], cut.layer, cut.split)
            .map_err(|e| Error::Config(format!("--cut-inside: {e}")))?;
    }
    Ok(())
}

/// The planner's whole-layer plan, refined by a cut inside a linear layer where that balances
/// the stages better (said in `report`, with the slowest stage either way).
fn refine_with_cut(
    planned: partition::Plan,
    body: &[LayerCost],
    geometry: &[Option<partition::Cuttable>],
    capacities: &[NodeCapacity],
    first_param: usize,
    shared: Option<&SharedCores>,
    report: &mut PlanReport,
) -> (partition::Plan, Vec<CutInside>, Vec<LayerCost>) {
    match partition::plan_best_cut(body, geometry, capacities, &planned, first_param, shared) {
        Some(refined) => {
            // What whole layers do on as many nodes as the cut plan uses.
            let m = refined.plan.stages.len();
            let whole_at_m = planned
                .by_nodes
                .iter()
                .find(|(n, _)| *n == m)
                .map_or(planned.bottleneck, |(_, b)| *b);
            for cut in &refined.cuts {
                let g = geometry[cut.layer].expect("only linear layers are cut");
                report.note(format!(
                    "cut inside layer {} (linear {}→{}) after {} of its outputs: whole \
                     layers could not balance the stages (the slowest {:.2} ms a \
                     micro-batch, {:.2} ms with the cut; --cut-inside false keeps whole \
                     layers)",
                    cut.layer,
                    g.in_features,
                    g.out_features,
                    cut.split,
                    whole_at_m * 1e3,
                    refined.plan.bottleneck * 1e3
                ));
            }
            (refined.plan, refined.cuts, refined.costs)
        }
        None => (planned, Vec::new(), body.to_vec()),
    }
}
