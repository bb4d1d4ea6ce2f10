//! Planning a ring run: from the run's configuration, the ring's options and the cluster to the
//! [`RingJob`] every node runs — the schedule, micro-batches, node speeds and memory limits, and
//! the partition (the planner's, from per-layer measurements, or the user's `--partition`).

pub mod node_profile;
pub mod options;
pub mod partition;
pub mod profile;

use ringtmp_data::Dataset;
use ringtmp_model::LayerKind;

use crate::contract::{Cluster, PlanReport, SharedMachine, show_bytes};
use crate::error::{Error, Result};
use crate::ring::plan::node_profile::ProfileRequest;
use crate::ring::plan::partition::{LayerCost, NodeCapacity, SharedCores};
use crate::ring::plan::profile::{InFlight, ProfileSettings, profile_layers};
use crate::ring::run::driver::RingJob;
use crate::ring::run::schedule::Schedule;
use crate::{ResumePoint, RunSpec, TrainConfig};

pub use options::{CutInsideChoice, RingOptions};

/// SGD momentum of the async schedule when the user gives none (see `plan`).
pub const ASYNC_MOMENTUM: f32 = 0.8;

/// Plans the ring job for `cluster.nodes` nodes, saying in `report` what it chose.
pub fn plan(
    mut cfg: TrainConfig,
    args: &RingOptions,
    cluster: &Cluster,
    data: &Dataset,
    report: &mut PlanReport,
) -> Result<RingJob> {
    let nodes = cluster.nodes;
    if cluster.threads.is_none() {
        // The local nodes share this machine's cores: split them instead of oversubscribing.
        cfg.threads = (cluster.cores / nodes.max(1) as usize).max(1);
    }
    if nodes < 2 {
        return Err(Error::Config(
            "--strategy ring needs --nodes of at least 2".into(),
        ));
    }
    args.check()?;
    // Rings of rings: the partition is planned once for one ring of `nodes / R`.
    let replicas = args.rings(nodes)?;
    if replicas == 0 || nodes as usize % replicas != 0 || nodes as usize / replicas < 2 {
        return Err(Error::Config(format!(
            "--replicas {replicas}: --nodes {nodes} must split into rings of at least 2 nodes \
             each"
        )));
    }
    let all_nodes = nodes;
    let nodes = nodes / replicas as u32;
    let (average_every, gossip_every) = match args.replica_sync.as_deref() {
        None | Some("gradients") => (0, 0),
        Some(text) => {
            let k = |prefix: &str| {
                text.strip_prefix(prefix)
                    .and_then(|k| k.parse::<u64>().ok())
                    .filter(|k| *k >= 1)
            };
            match (k("every:"), text == "adpsgd", k("adpsgd:")) {
                (Some(k), _, _) => (k, 0),
                (_, true, _) => (0, 1),
                (_, _, Some(k)) => (0, k),
                _ => {
                    return Err(Error::Config(format!(
                        "--replica-sync {text:?}: expected gradients, every:K, adpsgd or \
                         adpsgd:K (K ≥ 1)"
                    )));
                }
            }
        }
    };
    let (average_every, gossip_every) = if (average_every > 0 || gossip_every > 0) && replicas < 2 {
        // One ring (a sweep's smallest count under --ring-nodes): nothing to keep together.
        report.note("--replica-sync: one ring, no copies to keep together");
        (0, 0)
    } else {
        (average_every, gossip_every)
    };
    let gossip = gossip_every > 0;
    if gossip && replicas % 2 != 0 {
        return Err(Error::Config(format!(
            "--replica-sync adpsgd: the copies of a stage gossip on AD-PSGD's bipartite graph \
             (copies in even rings ask, those in odd rings answer), which needs an even number \
             of rings, not {replicas}; use every:K for an odd number"
        )));
    }
    let clipping = cfg.clip_grad_norm.is_some();
    let chosen = chosen_schedule(args, replicas, clipping);
    if clipping && chosen == Schedule::Async {
        return Err(Error::Config(
            "--clip-grad-norm needs a flushed schedule on the ring (--schedule 1f1b or gpipe): \
             under async every micro-batch updates each stage at its own time, so no step has \
             one gradient whose global norm all stages could share without stopping the \
             pipeline (--clip-grad-norm 0 trains without clipping)"
                .into(),
        ));
    }
    let schedule = match (args.schedule, replicas) {
        (s, r) if r > 1 && (average_every > 0 || gossip) => {
            let schedule = s.unwrap_or(Schedule::Async);
            let how = if gossip {
                format!(
                    "gossip their parameters (AD-PSGD's pairs, an exchange started every \
                     {gossip_every} mini-batch(es), nobody waiting) and average at the end"
                )
            } else {
                format!("average their parameters every {average_every} mini-batch(es)")
            };
            report.note(format!(
                "--replicas {r}: each ring trains on its own ({} schedule) and the copies of a \
                 stage {how}",
                schedule.name()
            ));
            schedule
        }
        (Some(Schedule::Async), r) if r > 1 => {
            return Err(Error::Config(
                "--replicas averages each stage's gradients at a flush: it needs --schedule \
                 1f1b or gpipe, or --replica-sync every:K (rings that train on their own and \
                 average their parameters every K mini-batches)"
                    .into(),
            ));
        }
        (None, r) if r > 1 => {
            report.note(format!(
                "--replicas {r}: schedule 1f1b (rings of rings step together)"
            ));
            Schedule::OneFOneB
        }
        (None, _) if clipping => {
            report.note(concat!(
                "schedule 1f1b: clipping by the global norm needs every stage's gradient of a ",
                "step before any stage updates (a flush)"
            ));
            Schedule::OneFOneB
        }
        (s, _) => s.unwrap_or(Schedule::Async),
    };
    debug_assert_eq!(
        schedule, chosen,
        "profile_request must time what the plan runs"
    );
    if replicas > 1 && (args.master_holds_head == Some(true) || args.stage_replicas.is_some()) {
        return Err(Error::Config(
            "--replicas does not go together with --master-holds-head or --stage-replicas yet"
                .into(),
        ));
    }
    if replicas > 1
        && average_every == 0
        && !gossip
        && cfg.default_lr
        && matches!(cfg.optimizer, ringtmp_model::OptimizerConfig::Sgd { .. })
    {
        // The default rate is one ring's batch's; a step here averages R of them (linear
        // scaling, as the data-parallel strategies do).
        cfg.lr *= replicas as f32;
    }
    if schedule == Schedule::Async
        && cfg.default_momentum
        && let ringtmp_model::OptimizerConfig::Sgd { momentum, .. } = &mut cfg.optimizer
    {
        // A micro-batch's gradient is a few steps stale by the time it is applied, and
        // staleness acts as momentum of its own (Mitliagkas et al., "Asynchrony begets
        // momentum", 2016): on top of SGD's usual 0.9 it made short runs of deep models
        // unstable. Measured (docs/BENCHMARKS.md): digits, mlp-deep, 230 steps: 0.9 ended at
        // 57–85% over three runs, 0.8 at 91.3–91.9%; MNIST mlp, 2 epochs: 97.6% against 97.4%;
        // MNIST mlp-deep, 1 epoch: 96.0% against 96.1%.
        *momentum = ASYNC_MOMENTUM;
        report.note(format!(
            "async schedule: SGD momentum {ASYNC_MOMENTUM} (the default for stale updates; \
             --momentum sets it)"
        ));
    }
    let micro_batches = args.micro_batches.unwrap_or(default_micro_batches(
        schedule,
        nodes as usize,
        cfg.batch_size,
        crate::sequence_of(data).unwrap_or(1),
    ));
    if micro_batches == 0 || micro_batches > cfg.batch_size {
        return Err(Error::Config(format!(
            "--micro-batches must be between 1 and the batch size {}",
            cfg.batch_size
        )));
    }
    // Every ring is split the same way, planned from the first ring's nodes.
    let speeds: Vec<f64> = cluster
        .node_speeds
        .iter()
        .take(nodes as usize)
        .copied()
        .collect();

    let layers = crate::layers_for(&cfg.model, data)?;
    // A limit is the whole process's (a board's memory, or --enforce-memory-limit's cgroup):
    // the stage gets what the process itself and, on the master, the dataset leave of it.
    let limits: Vec<Option<u64>> = cluster
        .memory_limits
        .iter()
        .take(nodes as usize)
        .enumerate()
        .map(|(rank, limit)| {
            let Some(limit) = *limit else { return Ok(None) };
            let needs = process_overhead(rank == 0, data, &layers);
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
    let mut capacities: Vec<NodeCapacity> = speeds
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
    let first_param = layers
        .iter()
        .position(|l| l.param_count() > 0)
        .ok_or_else(|| {
            Error::Config("the ring needs a model with at least one linear or conv layer".into())
        })?;
    let rows = cfg.batch_size.div_ceil(micro_batches);
    let in_flight = match schedule {
        Schedule::Gpipe => micro_batches,
        // The first stage's window (`StagePolicy::in_flight_limit`), the largest.
        Schedule::OneFOneB => (nodes as usize + 1).min(micro_batches),
        Schedule::Async => args.in_flight.unwrap_or(nodes as usize + 1),
    };
    // Memory is planned for the window the chosen ring keeps: the async default, one
    // micro-batch per node and one more (`Plan::window`), follows the number of nodes used, so
    // idle nodes cost the others nothing.
    let in_flight_planned = match (schedule, args.in_flight) {
        (Schedule::Async, None) => InFlight::PerNode { plus: 1 },
        _ => InFlight::Fixed(in_flight),
    };
    report.note(format!(
        "profiling {} layers on micro-batches of {rows} rows for the partition plan",
        layers.len()
    ));
    let steps_per_micro_batch = match schedule {
        Schedule::Async => 1.0,
        Schedule::Gpipe | Schedule::OneFOneB => 1.0 / micro_batches as f64,
    };
    let costs = profile_layers(
        &layers,
        &cfg.optimizer,
        &ProfileSettings {
            rows,
            threads: cfg.threads,
            in_flight: in_flight_planned,
            stashes_weights: schedule == Schedule::Async,
            steps_per_micro_batch,
            repeats: 9,
        },
    );
    use_own_profiles(
        cluster,
        &mut capacities,
        &OwnProfileCheck {
            rows,
            threads: cfg.threads,
            steps_per_micro_batch,
            costs: &costs,
            overhead: |rank| process_overhead(rank == 0, data, &layers),
        },
        report,
    );
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
    let body = &costs[..head_start];
    // Fewer nodes than given only for one plain ring: rings of rings are laid out by --nodes,
    // and stage replicas heal among all of them.
    let may_use_fewer =
        replicas == 1 && args.stage_replicas.is_none() && !args.use_all_nodes.unwrap_or(false);
    let links_counted = capacities.iter().any(|c| c.card_bytes_per_second.is_some());
    let shared = cluster
        .shared_machine
        .map(|machine| shared_cores(machine, body, cfg.threads));
    let planned = match &args.partition {
        Some(spec) => partition::from_spec(spec, body, &capacities, first_param).map(|stages| {
            let bottleneck = stages
                .iter()
                .map(|s| s.bottleneck())
                .fold(0.0, f64::max)
                .max(shared.map_or(0.0, |c| c.pace(body, &stages)));
            let round_trip = partition::round_trip(body, &stages, &capacities);
            partition::Plan {
                by_nodes: vec![(stages.len(), bottleneck)],
                stages,
                bottleneck,
                round_trip,
            }
        }),
        None => partition::plan_best(
            body,
            &capacities,
            first_param,
            !may_use_fewer,
            shared.as_ref(),
        ),
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
            LayerKind::Linear(linear) if l.input.as_flat().is_some() => Some(partition::Cuttable {
                in_features: linear.in_features,
                out_features: linear.out_features,
            }),
            _ => None,
        })
        .collect();
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
        (CutInsideChoice::At(cuts), None) if !cuts.is_empty() => {
            for cut in &cuts {
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
            let (work, caps) = partition::apply_cuts(body, &geometry, &capacities, &cuts);
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
            let planned = partition::plan_best_around(
                &work,
                &caps,
                first_param,
                !may_use_fewer,
                shared.as_ref(),
                &bounds,
            )
            .map_err(|e| Error::Config(e.to_string()))?;
            (planned, sorted, work)
        }
        (CutInsideChoice::Planner(true), None) => {
            match partition::plan_best_cut(
                body,
                &geometry,
                &capacities,
                &planned,
                first_param,
                shared.as_ref(),
            ) {
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
        _ => (planned, Vec::new(), body.to_vec()),
    };
    let body = body.as_slice();
    // The layers the stages index: the model's with the cuts made.
    let staged_layers = RingJob::cut_layers(layers.clone(), &cuts_inside)?;
    let plan = planned.stages.clone();
    let used = plan.len() as u32;
    let idle_nodes = nodes - used;
    if idle_nodes > 0 {
        let by: Vec<String> = planned
            .by_nodes
            .iter()
            .map(|(m, b)| format!("{m}: {:.2} ms", b * 1e3))
            .collect();
        let most = planned.by_nodes.iter().map(|(m, _)| *m).max().unwrap_or(0);
        let why = if most < nodes as usize {
            format!("more than {most} would have a node without parameters, which only relays")
        } else if let Some(shared) = &shared {
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
    let speeds: Vec<f64> = speeds.into_iter().take(used as usize).collect();
    // In the cut layers' positions: every cut is before the head, and each adds a layer.
    let head = (head_start < layers.len()).then(|| partition::StagePlan {
        rank: 0,
        start: head_start + cuts_inside.len(),
        end: staged_layers.len(),
        predicted_seconds: costs[head_start..].iter().map(|c| c.seconds).sum::<f64>() / speeds[0],
        predicted_bytes: costs[head_start..]
            .iter()
            .map(|c| c.bytes_in_ring(used as usize))
            .sum(),
        predicted_link_seconds: 0.0,
    });
    // The async window: enough micro-batches in flight to cover one's round trip at the
    // slowest stage's pace, as far as the memory limits allow (the plan counted one per node
    // and one more).
    let in_flight = match (schedule, args.in_flight) {
        (Schedule::Async, None) => {
            let window = planned.window();
            let fitting = plan
                .iter()
                .filter_map(|st| {
                    let limit = limits[st.rank as usize]?;
                    let on_node = |costs: &[LayerCost]| -> (u64, u64) {
                        costs.iter().fold((0, 0), |(b, p), c| {
                            (b + c.bytes_in_ring(used as usize), p + c.bytes_per_node)
                        })
                    };
                    let (mut bytes, mut per_micro_batch) = on_node(&body[st.start..st.end]);
                    if st.rank == 0 && head.is_some() {
                        let (b, p) = on_node(&costs[head_start..]);
                        bytes += b;
                        per_micro_batch += p;
                    }
                    let spare = limit.saturating_sub(bytes);
                    Some(
                        (used as usize + 1)
                            .saturating_add((spare / per_micro_batch.max(1)) as usize),
                    )
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
        (_, w) => w.unwrap_or(in_flight),
    };
    if let Some(h) = &head {
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
        match (links_counted, &shared) {
            (true, _) => "links counted at each node's card".to_string(),
            (false, Some(shared)) => format!(
                "the nodes share this machine's {}: each stage's compute and its links' CPU \
                 ({:.2} ms per MB, both ends) count against them, {:.2} ms per micro-batch in \
                 all; no bandwidth given (--bandwidth-mbit or --link)",
                shared.cores_named(),
                shared.link_cpu_seconds_per_byte * 1e9,
                shared.pace(body, &plan) * 1e3
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
        let link = match &shared {
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
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size * replicas)?;
    spec.config.out = std::path::absolute(&cfg.out).unwrap_or_else(|_| cfg.out.clone());
    if replicas > 1 {
        report.note(format!(
            "rings of rings: {replicas} rings of {nodes} nodes ({all_nodes} in all), each on {} \
             of every global batch of {}, stages averaging their {}; learning rate {}",
            cfg.batch_size,
            cfg.batch_size * replicas,
            if gossip {
                "parameters by asynchronous gossip".to_string()
            } else if average_every == 0 {
                "gradients before every step".to_string()
            } else {
                format!("parameters every {average_every} mini-batch(es)")
            },
            cfg.lr
        ));
    }
    if let Some(path) = &cfg.resume {
        let global = TrainConfig {
            batch_size: cfg.batch_size * replicas,
            ..cfg.clone()
        };
        let (dir, manifest) = crate::resume::check_resume(path, &global, data)?;
        report.note(format!(
            "resuming from {} at step {} (written by {}, its parameters in {} file(s))",
            dir.display(),
            manifest.step,
            manifest.strategy,
            manifest.files.len()
        ));
        spec.resume_from = Some(ResumePoint {
            dir: std::path::absolute(&dir).unwrap_or(dir),
            step: manifest.step,
        });
    }
    let job = RingJob {
        spec,
        micro_batches,
        schedule,
        partition: plan,
        cuts_inside,
        head,
        node_speeds: speeds,
        defer_weight_grads: args.defer_weight_grads.unwrap_or(true),
        in_flight: if schedule == Schedule::Async {
            in_flight
        } else {
            args.in_flight.unwrap_or(0)
        },
        idle_nodes,
        replica_every: args.stage_replicas.unwrap_or(0),
        replicas,
        average_every,
        gossip_every,
        ring: 0,
    };
    if job.replica_every > 0 {
        crate::ring::heal::replicas::check_replicas_fit(&job, &staged_layers, &limits)?;
        report.note(format!(
            "stage replicas: every node keeps its successor's block, refreshed every {} \
             mini-batches (a non-master node's death is healed without a restart)",
            job.replica_every
        ));
    }
    Ok(job)
}

/// The schedule `plan` chooses for these options with `replicas` rings (without its checks).
/// Micro-batches per mini-batch when the user names none. Async pipelines whole mini-batches
/// (each its own step, `nodes` of them in flight), so one micro-batch per mini-batch keeps the
/// GEMMs at full size. The flushed schedules need several per mini-batch to fill the pipeline:
/// one per node; for a language model more, while each still holds at least 64 positions
/// (`gpt-cpu`'s 12 windows of 64 become 12 micro-batches, which on two shared cores trained at
/// 0.95× of `local` where 2 gave 0.69×).
fn default_micro_batches(
    schedule: Schedule,
    nodes: usize,
    batch: usize,
    positions: usize,
) -> usize {
    match schedule {
        Schedule::Async => 1,
        Schedule::Gpipe | Schedule::OneFOneB if positions > 1 => {
            nodes.max((batch * positions / MIN_MICRO_BATCH_ROWS).min(batch))
        }
        Schedule::Gpipe | Schedule::OneFOneB => nodes,
    }
}

/// Rows (positions) a micro-batch of a flushed schedule keeps at least when the default splits a
/// mini-batch into more micro-batches than nodes.
const MIN_MICRO_BATCH_ROWS: usize = 64;

fn chosen_schedule(args: &RingOptions, replicas: usize, clipping: bool) -> Schedule {
    let syncing = replicas > 1
        && args
            .replica_sync
            .as_deref()
            .is_some_and(|s| s != "gradients");
    match (args.schedule, replicas) {
        (s, _) if syncing => s.unwrap_or(Schedule::Async),
        (None, r) if r > 1 || clipping => Schedule::OneFOneB,
        (s, _) => s.unwrap_or(Schedule::Async),
    }
}

/// What every node times at rendezvous for this plan (issue 17.2): the model, micro-batches of
/// the rows and threads [`plan`] will choose, and the optimizer, within `budget_seconds`.
pub fn profile_request(
    mut cfg: TrainConfig,
    args: &RingOptions,
    cluster: &Cluster,
    data: &Dataset,
    budget_seconds: f64,
) -> Result<ProfileRequest> {
    let nodes = cluster.nodes.max(1);
    if cluster.threads.is_none() {
        cfg.threads = (cluster.cores / nodes as usize).max(1);
    }
    let replicas = args.rings(nodes)?.max(1);
    let micro_batches = args
        .micro_batches
        .unwrap_or(default_micro_batches(
            chosen_schedule(args, replicas, cfg.clip_grad_norm.is_some()),
            nodes as usize / replicas,
            cfg.batch_size,
            crate::sequence_of(data).unwrap_or(1),
        ))
        .max(1);
    let (h, w, c) = data.input;
    Ok(ProfileRequest {
        model: cfg.model.clone(),
        input: (h, w, c),
        classes: data.classes,
        sequence: crate::sequence_of(data),
        optimizer: cfg.optimizer.clone(),
        rows: cfg.batch_size.div_ceil(micro_batches),
        threads: cfg.threads,
        budget_seconds,
    })
}

/// What a node's own profile must match to be used, and what its figures are compared with.
struct OwnProfileCheck<'a, F: Fn(u32) -> u64> {
    rows: usize,
    threads: usize,
    steps_per_micro_batch: f64,
    /// Rank 0's profile of the same layers.
    costs: &'a [partition::LayerCost],
    /// The process overhead of a rank (taken from its free memory).
    overhead: F,
}

/// Puts every node's own profile (issue 17.2) into its capacity: its seconds per layer, and its
/// free memory (less its process overhead) as a memory limit where that is tighter than the
/// given one; reports each node's measured speed relative to rank 0 on this model. A profile of
/// other rows, threads or layers is set aside with a warning (the node is then planned from
/// rank 0's profile and its `--node-speed`).
fn use_own_profiles<F: Fn(u32) -> u64>(
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
        crate::ring::plan::node_profile::machine_description()
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
fn shared_cores(machine: SharedMachine, costs: &[LayerCost], threads: usize) -> SharedCores {
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

/// What a node process needs besides its stage's parameters, gradients, optimizer state and
/// stashes, and besides its GEMM workspace: the binary, the runtimes' threads and buffers, the
/// allocator. Measured (docs/BENCHMARKS.md, issue 13.2): a lenet ring node with a 0.1 MB stage
/// peaks at 14–17 MB; wide-mlp's master, 25 MiB beyond its stage, workspace and dataset.
pub const PROCESS_BASELINE_BYTES: u64 = 32 << 20;

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
            ringtmp_data::Task::Classify => {
                (data.train.len() + data.test.len()) as u64 * (h * w * c + 1) as u64
            }
        }
    } else {
        0
    };
    PROCESS_BASELINE_BYTES + workspace + dataset
}
