//! From options to a run: the dataset the options name, the compute threads, and the job of the
//! chosen strategy (ripgrep's low-level → high-level arguments: after [`plan`], what runs is a
//! validated [`Job`]). Used by `ringtmp train` and by `ringtmp node` under external launchers.

use std::time::Instant;

use anyhow::Result;
use ringtmp_data::{Dataset, FileCheck};
use ringtmp_strategy::per_node::PerNode;
use ringtmp_strategy::ring::plan::node_profile::{NodeProfile, ProfileRequest};
use ringtmp_strategy::{Cluster, Job, PlanReport, SharedMachine, TrainConfig};

use crate::args::TrainArgs;
use crate::error::UsageError;

/// Loads the dataset named by the options and reports its checksum verification: on the terminal
/// when `announce`, else as an informational log line (a node whose launcher said it already).
pub fn load_dataset(args: &TrainArgs, announce: bool) -> Result<Dataset> {
    load_described(args, args.data_source()?.as_ref(), announce)
}

/// Loads the dataset of `args` (the bundled ones and text), or the user's own that `source`
/// describes (as a job carries it to the nodes).
pub fn load_described(
    args: &TrainArgs,
    source: Option<&ringtmp_data::DataSource>,
    announce: bool,
) -> Result<Dataset> {
    let name = args.dataset();
    let started = Instant::now();
    // The data crate's errors name the dataset and the files already.
    let data = if let Some(source) = source {
        ringtmp_data::load_source(source)?
    } else if name == "text" {
        ringtmp_data::load_text_dataset(&args.text_source().options())?
    } else {
        if args.data.data_file.is_some() {
            return Err(crate::error::UsageError(format!(
                "--data-file names text files or your own data (--dataset {}); {name} is read \
                 from --data-dir",
                ringtmp_data::FORMATS.join("|")
            ))
            .into());
        }
        ringtmp_data::load(&name, args.data.data_dir.as_deref())?
    };
    let verified = data
        .checks
        .iter()
        .filter(|c| matches!(c, FileCheck::Verified { .. }))
        .count();
    for check in &data.checks {
        if let FileCheck::Mismatch {
            path,
            expected,
            got,
        } = check
        {
            eprintln!(
                "WARNING: {} differs from the canonical {name}: SHA-256 {got}, expected {expected}. \
                 Results will not be comparable with published ones.",
                path.display()
            );
        }
    }
    let line = if let Some(source) = source {
        // The files themselves (a folder of images is one): the directory alone does not say
        // which table of it was read.
        let files: Vec<String> = source
            .files
            .iter()
            .map(|f| f.display().to_string())
            .collect();
        format!(
            "dataset {}: {} train / {} test examples from {}: {}; {:.1}s",
            data.name,
            data.train.len(),
            data.test.len(),
            files.join(", "),
            describe_own(&data),
            started.elapsed().as_secs_f64()
        )
    } else {
        format!(
            "dataset {name}: {} train / {} test examples from {} ({verified} of {} files match the canonical SHA-256; {:.1}s)",
            data.train.len(),
            data.test.len(),
            data.source.display(),
            data.checks.len(),
            started.elapsed().as_secs_f64()
        )
    };
    if announce {
        eprintln!("{line}");
    } else {
        tracing::info!("{line}");
    }
    Ok(data)
}

/// What a user's own dataset was read as: its input, its task and its normalisation.
fn describe_own(data: &Dataset) -> String {
    let r = &data.recipe;
    let (h, w, c) = data.input;
    let input = if h * w == 1 {
        format!("{c} input columns")
    } else if matches!(r.format.as_str(), "npy" | "npz") {
        format!("{h}×{w}×{c} inputs ({:?} in the files)", r.layout).to_lowercase()
    } else {
        format!("{h}×{w}×{c} images")
    };
    let task = match data.task {
        ringtmp_data::Task::Regress => format!(
            "regression on {}",
            if r.targets.is_empty() {
                format!("{} targets", data.classes)
            } else {
                r.targets.join(", ")
            }
        ),
        _ if !r.class_names.is_empty() => format!(
            "{} classes ({}{})",
            data.classes,
            r.class_names[..r.class_names.len().min(4)].join(", "),
            if r.class_names.len() > 4 { ", …" } else { "" }
        ),
        _ => format!("{} classes", data.classes),
    };
    let label = r
        .label
        .as_ref()
        .map(|l| format!(" from column {l:?}"))
        .unwrap_or_default();
    let n = &r.normalisation;
    let norm = if n.mean.iter().all(|&m| m == 0.0) && n.std.iter().all(|&s| s == 1.0) {
        "not normalised".to_string()
    } else if n.channels() > 4 {
        format!(
            "normalised per column ({} means and deviations)",
            n.channels()
        )
    } else {
        let list = |v: &[f32]| {
            v.iter()
                .map(|x| format!("{x:.4}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "normalised with mean [{}] and std [{}]",
            list(&n.mean),
            list(&n.std)
        )
    };
    format!("{input}, {task}{label}, {norm}")
}

/// Plans the job of `args`'s strategy for `nodes` nodes from the resolved configuration: the one
/// place where flags become a job, for the local launcher and external launchers alike.
pub fn plan(args: &TrainArgs, cfg: TrainConfig, data: &Dataset, nodes: u32) -> Result<Job> {
    plan_with_profiles(args, cfg, data, nodes, Vec::new())
}

/// The machines of a run of `nodes` nodes as the options describe them.
pub fn cluster(args: &TrainArgs, nodes: u32) -> Result<Cluster> {
    let mut cluster = Cluster::local(nodes)
        .with_speeds(&PerNode::joined(args.cluster.node_speed.iter().flatten()))
        .and_then(|c| c.with_memory_limits(args.cluster.node_memory_limit.as_ref()))
        .map_err(|e| UsageError(e.to_string()))?;
    cluster.threads = args.training.threads;
    cluster.links = args
        .node_links(nodes)?
        .iter()
        .map(|card| (card.mbit, card.latency_ms))
        .collect();
    Ok(cluster)
}

/// What every node should time at rendezvous for this plan, or `None` when the
/// strategy's plan does not use the nodes' speeds.
pub fn profile_request(
    args: &TrainArgs,
    cfg: TrainConfig,
    data: &Dataset,
    nodes: u32,
    budget_seconds: f64,
) -> Result<Option<ProfileRequest>> {
    let cluster = cluster(args, nodes)?;
    Ok(Job::profile_request(
        args.strategy(),
        cfg,
        &args.strategy_options(),
        &cluster,
        data,
        budget_seconds,
    )?)
}

/// [`plan`] with every node's own profile from rendezvous (by rank; `None`: planned from rank
/// 0's profile).
pub fn plan_with_profiles(
    args: &TrainArgs,
    cfg: TrainConfig,
    data: &Dataset,
    nodes: u32,
    profiles: Vec<Option<NodeProfile>>,
) -> Result<Job> {
    let mut cluster = cluster(args, nodes)?;
    cluster.node_profiles = profiles;
    plan_on(args, cfg, data, &cluster)
}

/// [`plan`] for the local launcher's nodes, processes on this machine: unless they run under
/// CPU quotas of their own (`--node-cpu`, given here per rank), they share its cores, and the
/// planner counts what they all compute and what their links cost the CPU against them.
pub fn plan_here(
    args: &TrainArgs,
    cfg: TrainConfig,
    data: &Dataset,
    nodes: u32,
    cpu_quotas: &[Option<f64>],
) -> Result<Job> {
    let mut cluster = cluster(args, nodes)?;
    if cpu_quotas.iter().all(Option::is_none) {
        cluster.shared_machine = Some(SharedMachine {
            cores: cluster.cores,
            private_links: !args.faults.insecure_plaintext.unwrap_or(false),
        });
    }
    plan_on(args, cfg, data, &cluster)
}

fn plan_on(args: &TrainArgs, cfg: TrainConfig, data: &Dataset, cluster: &Cluster) -> Result<Job> {
    // Before a planner times any layer: one thread's scratch must fit, whatever the threads.
    refuse_what_cannot_fit(&cfg, 1, "", data)?;
    let mut report = PlanReport::default();
    let job = Job::plan(
        args.strategy(),
        cfg,
        &args.strategy_options(),
        cluster,
        data,
        &mut report,
    );
    // What the planner chose, also when it then refused the run.
    for line in report.lines() {
        eprintln!("{line}");
    }
    let job = job?;
    job.validate(cluster.nodes)?;
    refuse_nothing_to_train(job.spec())?;
    let spec = job.spec();
    refuse_what_cannot_fit(&spec.config, spec.config.threads, job.name(), data)?;
    Ok(job)
}

/// Refuses, with the figures, a run whose node would need more memory than this machine has
/// available before anything large is allocated: the attention's scratch, two `[seq, seq]`
/// matrices (scores and their gradient) per compute thread, which grows with the square of
/// the window; and for one process holding the whole model, its parameters, gradients and
/// optimizer state.
fn refuse_what_cannot_fit(
    config: &TrainConfig,
    threads: usize,
    strategy: &str,
    data: &Dataset,
) -> Result<()> {
    let Some(available) = ringtmp_strategy::machine::available_memory() else {
        return Ok(());
    };
    let layers = ringtmp_strategy::layers_for(&config.model, data)?;
    let window = layers
        .iter()
        .filter(|l| {
            matches!(
                l.kind,
                ringtmp_model::LayerKind::CausalSelfAttention(_)
                    | ringtmp_model::LayerKind::Block(_)
                    | ringtmp_model::LayerKind::LlamaBlock(_)
            )
        })
        .filter_map(|l| l.input.0.first().map(|&t| t as u64))
        .max();
    let mib = |bytes: u64| bytes >> 20;
    if let Some(t) = window {
        let per_thread = t.saturating_mul(t).saturating_mul(2 * 4);
        let scratch = per_thread.saturating_mul(threads as u64);
        if scratch > available {
            return Err(UsageError(format!(
                "a window of {t} positions needs {} MiB of attention scratch per compute thread \
                 (its [{t}, {t}] scores and their gradient), {} MiB on {} thread(s), and this \
                 machine has {} MiB available: use a shorter --seq-len (or fewer --threads)",
                mib(per_thread),
                mib(scratch),
                threads,
                mib(available)
            ))
            .into());
        }
    }
    if strategy == "local" {
        let floor = ringtmp_strategy::memory_floor::whole_replica(&layers, &config.optimizer);
        if floor.bytes() > available {
            return Err(UsageError(format!(
                "the model's {} parameters{} take {} MiB, and this machine has {} MiB \
                 available: split it over nodes (--strategy ring) or choose a smaller model",
                floor.params,
                floor.what,
                mib(floor.bytes()),
                mib(available)
            ))
            .into());
        }
    }
    Ok(())
}

/// A checkpoint of a run's last step, resumed into another directory, would train nothing
/// there and report a run of no samples: refused, saying so. Resumed in its own directory it
/// reports the finished run again.
fn refuse_nothing_to_train(spec: &ringtmp_strategy::RunSpec) -> Result<()> {
    let Some(resume) = spec.config.resume.as_deref() else {
        return Ok(());
    };
    if spec.first_step() < spec.total_steps
        || crate::run_dir::resumes_from(&spec.config.out, Some(resume))
    {
        return Ok(());
    }
    Err(UsageError(format!(
        "--resume {}: the checkpoint is at step {}, where this run ends ({} steps: {}); nothing \
         is left to train into {}. Give more --epochs or --max-steps to go on, or resume into \
         the run's own directory to report it again",
        resume.display(),
        spec.first_step(),
        spec.total_steps,
        match spec.config.max_steps {
            Some(m) if m == spec.total_steps => format!("--max-steps {m}"),
            _ => format!(
                "{} epoch(s) of {} steps",
                spec.config.epochs, spec.steps_per_epoch
            ),
        },
        spec.config.out.display()
    ))
    .into())
}

/// Sizes rayon's global pool (through which the kernels parallelise) to the thread budget, and
/// makes every compute thread flush subnormals. Only the first call in a process has an effect.
pub fn init_threads(threads: usize) -> Result<()> {
    ringtmp_model::kernels::flush_denormals();
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .start_handler(|_| ringtmp_model::kernels::flush_denormals())
        .build_global();
    if built.is_err() && rayon::current_num_threads() != threads.max(1) {
        tracing::warn!(
            "compute threads already set to {}",
            rayon::current_num_threads()
        );
    }
    Ok(())
}
