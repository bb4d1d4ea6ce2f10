//! Planning a ring run: from the run's configuration, the ring's options and the cluster to the
//! [`RingJob`] every node runs — the schedule, micro-batches, node speeds and memory limits, and
//! the partition (the planner's, from per-layer measurements, or the user's `--partition`).

mod capacity;
mod choice;
pub mod node_profile;
pub mod options;
pub mod partition;
pub mod profile;
pub mod replica_sync;
pub mod settings;

use ringtmp_data::Dataset;

use crate::plan::node_profile::ProfileRequest;
use crate::plan::profile::{ProfileSettings, profile_layers};
use crate::run::driver::RingJob;
use crate::run::schedule::Schedule;
use ringtmp_contract::contract::{Cluster, PlanReport};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::{ResumePoint, RunSpec, TrainConfig};

use choice::Chosen;

pub use capacity::{PROCESS_BASELINE_BYTES, process_overhead};
pub use options::{CutInsideChoice, RingOptions};
pub use partition::StageRanges;
pub use settings::{ASYNC_MOMENTUM, Settings};

/// Plans the ring job for `cluster.nodes` nodes, saying in `report` what it chose.
#[expect(
    clippy::too_many_lines,
    reason = "the ring's planning steps in order, each noted in the report"
)]
pub fn plan(
    mut cfg: TrainConfig,
    args: &RingOptions,
    cluster: &Cluster,
    data: &Dataset,
    report: &mut PlanReport,
) -> Result<RingJob> {
    let settings = settings::resolve(&mut cfg, args, cluster, data, report)?;
    let Settings {
        replicas,
        nodes,
        average_every,
        gossip_every,
        outer_sync,
        schedule,
        micro_batches,
        rows,
        in_flight,
        in_flight_planned,
        steps_per_micro_batch,
        ..
    } = settings.clone();
    let layers = ringtmp_contract::layers_for(&cfg.model, data)?;
    let (speeds, limits, mut capacities) = capacity::capacities(cluster, nodes, data, &layers)?;
    let first_param = layers
        .iter()
        .position(|l| l.param_count() > 0)
        .ok_or_else(|| {
            Error::Config("the ring needs a model with at least one linear or conv layer".into())
        })?;
    report.note(format!(
        "profiling {} layers on micro-batches of {rows} rows for the partition plan",
        layers.len()
    ));
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
    let eval = capacity::eval_plan(
        &costs,
        rows,
        ringtmp_contract::evaluation::eval_chunk(&data.test, data.classes),
        capacities.iter().filter_map(|c| c.memory_limit).min(),
    );
    if capacities.iter().any(|c| c.memory_limit.is_some()) {
        for c in &mut capacities {
            c.memory_limit = c.memory_limit.map(|m| m.saturating_sub(eval.bytes));
        }
        report.note(format!(
            "evaluation: passes of {} {} around the ring, {} a node for them",
            eval.rows,
            if ringtmp_contract::sequence_of(data).is_some() {
                "windows"
            } else {
                "examples"
            },
            ringtmp_contract::contract::show_bytes(eval.bytes)
        ));
    }
    capacity::use_own_profiles(
        cluster,
        &mut capacities,
        &capacity::OwnProfileCheck {
            rows,
            threads: cfg.threads,
            steps_per_micro_batch,
            costs: &costs,
            overhead: |rank| capacity::process_overhead(rank == 0, data, &layers),
        },
        report,
    );
    let Chosen {
        planned,
        cuts_inside,
        body,
        head_start,
        shared,
        links_counted,
    } = choice::choose(
        args,
        &layers,
        &costs,
        &capacities,
        cluster.shared_machine,
        cfg.threads,
        schedule,
        replicas,
        first_param,
        report,
    )?;
    let body = body.as_slice();
    // The layers the stages index: the model's with the cuts made.
    let staged_layers = RingJob::cut_layers(layers.clone(), &cuts_inside)?;
    let plan = planned.stages.clone();
    let used = plan.len() as u32;
    let idle_nodes = nodes - used;
    if idle_nodes > 0 {
        choice::note_idle_nodes(&planned, shared.as_ref(), nodes, report);
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
            .map(|c| c.bytes_at(used as usize, used as usize))
            .sum(),
        predicted_link_seconds: 0.0,
    });
    let in_flight = match (schedule, args.in_flight) {
        (Schedule::Async, None) => choice::async_window(
            &planned,
            &limits,
            body,
            &costs[head_start..],
            head.is_some(),
            report,
        ),
        (_, w) => w.unwrap_or(in_flight),
    };
    choice::note_partition(
        &plan,
        &staged_layers,
        body,
        head.as_ref(),
        schedule,
        micro_batches,
        links_counted,
        shared.as_ref(),
        report,
    );
    let spec = run_spec(&cfg, &settings, data, report)?;
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
        // Rings of rings take a replication round after every synchronisation.
        replica_every: match args.stage_replicas {
            Some(_) if replicas > 1 => average_every,
            every => every.unwrap_or(0),
        },
        replicas,
        average_every,
        gossip_every,
        outer_sync,
        eval_rows: eval.rows,
        ring: 0,
    };
    if job.replica_every > 0 {
        crate::heal::replicas::check_replicas_fit(&job, &staged_layers, &limits)?;
        report.note(format!(
            "stage replicas: every node keeps its successor's block, refreshed every {} \
             mini-batches (a non-master node's death is healed without a restart)",
            job.replica_every
        ));
    }
    Ok(job)
}

/// What every node times at rendezvous for this plan: the model, micro-batches of the rows and
/// threads [`plan`] will choose, and the optimizer, within `budget_seconds`.
pub fn profile_request(
    mut cfg: TrainConfig,
    args: &RingOptions,
    cluster: &Cluster,
    data: &Dataset,
    budget_seconds: f64,
) -> Result<ProfileRequest> {
    let rows = settings::profiled_rows(&mut cfg, args, cluster, data)?;
    let (h, w, c) = data.input;
    Ok(ProfileRequest {
        model: cfg.model.clone(),
        input: (h, w, c),
        classes: data.classes,
        sequence: ringtmp_contract::sequence_of(data),
        optimizer: cfg.optimizer.clone(),
        rows,
        threads: cfg.threads,
        budget_seconds,
    })
}

/// What every ring's job shares: the run's spec over the global batch of all the rings, and
/// where a resumed run starts (said in `report`, with the rings of rings' layout).
fn run_spec(
    cfg: &TrainConfig,
    settings: &Settings,
    data: &Dataset,
    report: &mut PlanReport,
) -> Result<RunSpec> {
    let replicas = settings.replicas;
    let mut spec = RunSpec::new(cfg.clone(), data, cfg.batch_size * replicas)?;
    spec.config.out = std::path::absolute(&cfg.out).unwrap_or_else(|_| cfg.out.clone());
    if replicas > 1 {
        report.note(format!(
            "rings of rings: {replicas} rings of {} nodes ({} in all), each on {} \
             of every global batch of {}, stages averaging their {}; learning rate {}",
            settings.nodes,
            settings.all_nodes,
            cfg.batch_size,
            cfg.batch_size * replicas,
            if settings.gossip() {
                "parameters by asynchronous gossip".to_string()
            } else if settings.average_every == 0 {
                "gradients before every step".to_string()
            } else if settings.outer_sync.is_some() {
                format!(
                    "pseudo-gradients through a DiLoCo outer step every {} mini-batch(es)",
                    settings.average_every
                )
            } else {
                format!("parameters every {} mini-batch(es)", settings.average_every)
            },
            cfg.lr
        ));
    }
    if let Some(path) = &cfg.resume {
        let global = TrainConfig {
            batch_size: cfg.batch_size * replicas,
            ..cfg.clone()
        };
        let (dir, manifest) = ringtmp_contract::resume::check_resume(path, &global, data)?;
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
    Ok(spec)
}
