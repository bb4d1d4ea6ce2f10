//! `ringtmp node`: join a run started elsewhere (by the local launcher, mpirun, srun, torchrun,
//! a Kubernetes indexed job, or by hand). Placement comes from flags or the launcher's environment;
//! every job setting comes from rank 0 at rendezvous, so nodes cannot disagree.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use clap::{Args, ValueEnum};
use ringtmp_cluster::launch::{LaunchFlags, resolve};
use ringtmp_cluster::node::{JoinOptions, join};
use ringtmp_cluster::rendezvous::{FromAnswers, Offer};
use ringtmp_strategy::contract::ring_neighbours;
use ringtmp_strategy::ring::plan::node_profile::{self, ProfileReply};
use ringtmp_strategy::selftest::{self, SelftestConfig};
use ringtmp_strategy::{Job, NodeCx};
use ringtmp_transport::TransportConfig;
use serde::{Deserialize, Serialize};

use crate::args::TrainArgs;
use crate::error::UsageError;
use crate::links::{CardArgs, LinkSpec};
use ringtmp_strategy::generate::GenerateJob;

/// What the nodes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeJob {
    /// Connectivity check and link measurements around the ring.
    Selftest,
    /// Training with the options of `--config` (rank 0's file).
    Train,
    /// Generation from a language model split over the nodes (`ringtmp generate --nodes`;
    /// rank 0's `--job-file`).
    Generate,
}

/// What rank 0 hands every node at rendezvous (JSON).
#[derive(Serialize, Deserialize)]
#[serde(tag = "job", rename_all = "kebab-case")]
pub(crate) enum Settings {
    Selftest {
        size_mib: f64,
        rounds: u32,
        pings: u32,
    },
    /// A training job of any strategy (tagged by its `strategy`).
    Train(Box<Job>),
    /// A split generation.
    Generate(Box<GenerateJob>),
}

/// Job settings; rank 0's are handed to every node at rendezvous.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct JobArgs {
    /// The job.
    #[arg(long, value_enum, default_value = "selftest")]
    pub job: NodeJob,
    /// Selftest: MiB per tensor in the bandwidth rounds.
    #[arg(long, default_value_t = 4.0)]
    pub size_mib: f64,
    /// Selftest: bandwidth rounds.
    #[arg(long, default_value_t = 10)]
    pub rounds: u32,
    /// Selftest: ping/pong round trips.
    #[arg(long, default_value_t = 200)]
    pub pings: u32,
    /// Train: the training options (a `ringtmp train --config` file); read by rank 0 only.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Train: resume from this checkpoint or run directory, or `auto`: the newest checkpoint under
    /// the run's --out that verifies, else from the beginning (for Slurm's requeue or a
    /// Kubernetes restart policy); rank 0 only.
    #[arg(long, value_name = "DIR|auto")]
    #[serde(skip)]
    pub resume: Option<PathBuf>,
    /// Train: the job already planned (written by the local launcher); rank 0 only.
    #[arg(long, value_name = "FILE", hide = true)]
    #[serde(skip)]
    pub job_file: Option<PathBuf>,
    /// Train, ring: plan from rank 0's profile alone (scaled by `--node-speed`), without asking
    /// every node to time the model on its own hardware at rendezvous; rank 0 only.
    #[arg(long)]
    #[serde(skip)]
    pub no_node_profile: bool,
    /// Train, ring: seconds each node may spend timing the model at rendezvous (after one
    /// warm-up pass per layer); rank 0 only.
    #[arg(long, default_value_t = 3.0, value_name = "SECONDS")]
    #[serde(skip)]
    pub profile_budget: f64,
}

/// How this node connects.
#[derive(Args, Clone, Debug)]
pub struct ConnectArgs {
    /// This node's rank (with --world-size; otherwise from the launcher's environment).
    #[arg(long)]
    pub rank: Option<u32>,
    /// Number of nodes.
    #[arg(long)]
    pub world_size: Option<u32>,
    /// Rank 0's rendezvous host.
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Rank 0's rendezvous port.
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Host or IP this node listens on for its peers (0.0.0.0 for all interfaces).
    #[arg(long, default_value = "127.0.0.1")]
    pub listen: String,
    /// File holding the run's shared secret (else the RINGTMP_SECRET variable).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Seconds allowed for rendezvous and for connecting to peers.
    #[arg(long, default_value_t = 30.0)]
    pub connect_timeout: f64,
    /// Milliseconds between heartbeats on each link.
    #[arg(long, default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// Seconds of silence after which a peer is declared dead.
    #[arg(long, default_value_t = 5.0)]
    pub peer_timeout: f64,
    /// Seconds to wait for any one message before giving up [default: 30 for the selftest; for
    /// training, the run's own --recv-timeout (300)].
    #[arg(long)]
    pub recv_timeout: Option<f64>,
    /// This node's emulated card.
    #[command(flatten)]
    pub card: CardArgs,
    /// Pin this process to one CPU core.
    #[arg(long)]
    pub cpu: Option<usize>,
    /// Time the model again when rank 0 asks, instead of answering from this machine's profile
    /// cache ($RINGTMP_CACHE_DIR/profiles, else ~/.cache/ringtmp/profiles).
    #[arg(long)]
    pub fresh_profile: bool,
    /// Send frames in the clear after the authenticated greeting (links are encrypted and
    /// authenticated by default); every node of the run must say the same.
    #[arg(long)]
    pub insecure_plaintext: bool,
    /// Fault injection for tests: exit abruptly (no goodbye) this many milliseconds after the
    /// links are up.
    #[arg(long, hide = true)]
    pub crash_after_ms: Option<u64>,
    /// Fault injection for tests: stop this process (SIGSTOP, as `kill -STOP` does) this many
    /// milliseconds after the links are up.
    #[arg(long, hide = true)]
    pub freeze_after_ms: Option<u64>,
    /// Fault injection for tests: block this process's main thread (its training) this many
    /// milliseconds after the links are up, leaving its links alive (heartbeats go on).
    #[arg(long, hide = true)]
    pub hang_after_ms: Option<u64>,
}

/// `ringtmp node` options.
#[derive(Args, Clone, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    connect: ConnectArgs,
    #[command(flatten)]
    job: JobArgs,
    /// Train: `ringtmp train`'s options, after `--` (`ringtmp node --job train -- --strategy
    /// ring --model cnn`); over `--config`'s file where both are given, as on `ringtmp train`.
    /// Read by rank 0 only: the others take the job from rank 0 at rendezvous, so one command
    /// line serves every rank of `mpirun` or `srun`.
    #[arg(last = true, value_name = "TRAIN OPTIONS")]
    train: Vec<String>,
}

/// The `ringtmp train` options given after `--`, parsed as `ringtmp train` parses them.
#[derive(clap::Parser)]
#[command(name = "ringtmp node --job train --")]
struct TrainFlags {
    #[command(flatten)]
    args: TrainArgs,
}

/// Rank 0's training options: those after `--`, over `--config`'s file.
fn train_options(args: &NodeArgs) -> Result<TrainArgs> {
    use clap::Parser;
    let mut train_args = if args.train.is_empty() {
        TrainArgs::default()
    } else {
        let words = std::iter::once("train".to_string()).chain(args.train.iter().cloned());
        TrainFlags::try_parse_from(words)
            .map_err(|e| UsageError(format!("the training options after --: {}", e.render())))?
            .args
    };
    if train_args.config.is_none() {
        train_args.config = args.job.config.clone();
    }
    if train_args.config.is_none() && args.train.is_empty() {
        return Err(UsageError(
            "--job train needs the training options on rank 0: `-- TRAIN OPTIONS` (as `ringtmp \
             train` takes them) or --config FILE"
                .into(),
        )
        .into());
    }
    train_args.merged()
}

/// Reads the shared secret from `--secret-file` or `RINGTMP_SECRET`.
fn secret(args: &ConnectArgs) -> Result<Vec<u8>> {
    let secret = match &args.secret_file {
        Some(path) => std::fs::read(path).with_context(|| format!("reading the secret file {}", path.display()))?,
        None => std::env::var("RINGTMP_SECRET").map(String::into_bytes).map_err(|_| {
            UsageError("no shared secret: pass --secret-file FILE or set RINGTMP_SECRET (`ringtmp train --nodes N` generates one)".into())
        })?,
    };
    let trimmed = String::from_utf8_lossy(&secret).trim().as_bytes().to_vec();
    if trimmed.len() < 16 {
        return Err(UsageError("the shared secret must have at least 16 characters".into()).into());
    }
    Ok(trimmed)
}

fn seconds(name: &str, v: f64) -> Result<Duration> {
    crate::args::check_timeout(name, v)?;
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| UsageError(format!("--{name} must be a positive number of seconds")).into())
}

/// `ringtmp node`.
#[expect(
    clippy::too_many_lines,
    reason = "a rank's life under any launcher in order: rendezvous, plan, files, run, report"
)]
pub fn run(args: &NodeArgs) -> Result<()> {
    let c = &args.connect;
    if let Some(core) = c.cpu {
        pin_to_core(core)?;
    }
    // The hypervisor's steal on the node's core counts from here (`steal_seconds`).
    ringtmp_metrics::resources::mark_start();
    let flags = LaunchFlags {
        rank: c.rank,
        world_size: c.world_size,
        master_addr: c.master_addr.clone(),
        master_port: c.master_port,
    };
    let placement =
        resolve(&flags, &|k| std::env::var(k).ok()).map_err(|e| UsageError(e.to_string()))?;
    let line = format!(
        "node: rank {} of {} (from {}); rendezvous at {}:{}",
        placement.rank,
        placement.world_size,
        placement.source,
        placement.master_addr,
        placement.master_port
    );
    // Under an external launcher this line says which environment fired; under ours, the
    // launcher has said it all.
    if std::env::var_os(crate::launcher::LOCAL_LAUNCHER_ENV).is_some() {
        tracing::info!("{line}");
    } else {
        eprintln!("{line}");
    }
    if let Some(v) = c.recv_timeout {
        crate::args::check_timeout("recv-timeout", v)?;
    }
    let secret = secret(c)?;
    let mut transport = TransportConfig::new(0, placement.rank, secret.clone());
    transport.heartbeat_interval = Duration::from_millis(c.heartbeat_ms.max(1));
    transport.peer_timeout = seconds("peer-timeout", c.peer_timeout)?;
    transport.encrypt = !c.insecure_plaintext;
    if c.insecure_plaintext && placement.rank == 0 {
        eprintln!(
            "WARNING: --insecure-plaintext: models, gradients and data travel unencrypted and \
             unauthenticated after the greeting; anyone on the path can read or alter them"
        );
    }
    let card = c.card.card()?;
    transport.shaping = card.shaping();
    let options = JoinOptions {
        listen_host: c.listen.clone(),
        secret,
        connect_timeout: seconds("connect-timeout", c.connect_timeout)?,
        transport,
    };
    // Rank 0 decides what everybody runs; the others' job options are ignored.
    let offer = if placement.rank == 0 {
        match args.job.job {
            NodeJob::Selftest => Offer::Settings(encode(&Settings::Selftest {
                size_mib: args.job.size_mib,
                rounds: args.job.rounds,
                pings: args.job.pings,
            })?),
            NodeJob::Train => rank0_offer(args, placement.world_size)?,
            NodeJob::Generate => {
                let path = args.job.job_file.as_ref().ok_or_else(|| {
                    UsageError("--job generate needs --job-file on rank 0".into())
                })?;
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let job: GenerateJob = serde_json::from_str(&text)
                    .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
                Offer::Settings(encode(&Settings::Generate(Box::new(job)))?)
            }
        }
    } else {
        Offer::Settings(String::new())
    };
    let cache = node_profile::default_cache_dir();
    let fresh = c.fresh_profile;
    let links = node_profile::OwnLinks {
        card_mbit: card.mbit,
        latency_ms: card.latency_ms,
        encrypt: !c.insecure_plaintext,
    };
    let answer = move |request: &str| {
        // The compute pool is sized once per process: size it for the job (the request's
        // threads are the job's) before the profile's kernels first use it.
        if let Ok(r) = serde_json::from_str::<node_profile::ProfileRequest>(request) {
            let _ = crate::plan::init_threads(r.threads);
        }
        node_profile::answer(request, cache.as_deref(), fresh, links)
    };
    let (table, mut net) = join(
        &placement,
        &options,
        offer,
        &answer,
        |rank, world, settings| match serde_json::from_str::<Settings>(settings) {
            Ok(Settings::Train(job)) => job.neighbours(rank, world),
            _ => ring_neighbours(rank, world),
        },
    )?;
    // Injected faults count from when the links are up, so they strike the run itself
    // however long starting took.
    if let Some(ms) = c.crash_after_ms {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            eprintln!("fault injection: exiting abruptly");
            std::process::exit(3);
        });
    }
    if let Some(ms) = c.freeze_after_ms {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            eprintln!("fault injection: freezing (SIGSTOP)");
            // SAFETY: raise(3) signals this process only.
            unsafe { libc::raise(libc::SIGSTOP) };
        });
    }
    if let Some(ms) = c.hang_after_ms {
        hang_main_thread_after(Duration::from_millis(ms));
    }
    // What rank 0 handed out is checked before anything uses it: a bad job is rank 0's
    // protocol violation (exit status 1), named as such.
    let master = table
        .addr(0)
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let settings: Settings = serde_json::from_str(&table.settings)
        .map_err(|e| anyhow!("rank 0 ({master}) handed out settings that do not parse: {e}"))?;
    if placement.rank != 0 {
        let valid = match &settings {
            Settings::Train(job) => job.validate(placement.world_size),
            Settings::Generate(job) => job.validate(placement.world_size),
            Settings::Selftest { .. } => Ok(()),
        };
        valid.map_err(|e| anyhow!("rank 0 ({master}) handed out an invalid job: {}", e))?;
    }
    let result: Result<()> = match settings {
        Settings::Selftest {
            size_mib,
            rounds,
            pings,
        } => {
            let cfg = SelftestConfig {
                size_bytes: ((size_mib * 1024.0 * 1024.0) as usize / 4).max(1) * 4,
                rounds,
                pings,
                timeout: seconds("recv-timeout", c.recv_timeout.unwrap_or(30.0))?,
            };
            selftest::run(&mut net, placement.world_size, table.run_id, cfg)
                .map(|reports| print_selftest(placement.rank, &reports, size_mib, rounds, pings))
                .map_err(Into::into)
        }
        Settings::Train(mut job) => {
            if std::env::var_os(crate::launcher::LOCAL_LAUNCHER_ENV).is_none() {
                own_threads(&mut job, placement.rank, &table);
            }
            run_training(&job, placement.rank, args, &mut net)
        }
        Settings::Generate(job) => run_generation(&job, placement.rank, &mut net),
    };
    match result {
        Ok(()) => {
            net.close()?;
            Ok(())
        }
        Err(e) => {
            net.abort(&crate::error::describe(&e));
            Err(e)
        }
    }
}

fn encode(settings: &Settings) -> Result<String> {
    serde_json::to_string(settings).context("encoding the job settings")
}

/// What rank 0 offers at rendezvous for a training job: the local launcher's job file as it is
/// (its nodes share this machine, planned before they started); under an external launcher
/// the plan from `--config`, made once every node has timed the model on its own hardware
/// unless `--no-node-profile` or the strategy does not use it.
fn rank0_offer(args: &NodeArgs, world: u32) -> Result<Offer> {
    let prepared = match rank0_job(args, world)? {
        Rank0Job::Planned(job) => return Ok(Offer::Settings(encode(&Settings::Train(job))?)),
        Rank0Job::Prepared(p) => p,
    };
    let Prepared {
        mut train_args,
        cfg,
        data,
    } = *prepared;
    // Rank 0's own card (its command line's) counts like the other nodes' (they report theirs
    // with their profiles) where the run's options name none.
    let declared = train_args.cluster.card.bandwidth_mbit.is_some()
        || train_args
            .cluster
            .link
            .iter()
            .flatten()
            .any(|l| l.rank == 0);
    let own = args.connect.card.card()?;
    if let Some(mbit) = own.mbit
        && !declared
        && !args.job.no_node_profile
        && train_args.strategy() == "ring"
    {
        let link = LinkSpec {
            rank: 0,
            mbit,
            latency_ms: Some(own.latency_ms),
        };
        train_args
            .cluster
            .link
            .get_or_insert_with(Vec::new)
            .push(link);
    }
    let budget = args.job.profile_budget;
    if !budget.is_finite() || budget < 0.0 {
        return Err(UsageError(format!(
            "--profile-budget must be a number of seconds ≥ 0, not {budget}"
        ))
        .into());
    }
    let request = if args.job.no_node_profile || world < 2 {
        None
    } else {
        crate::plan::profile_request(
            &train_args,
            cfg.clone(),
            &data,
            world,
            args.job.profile_budget,
        )?
    };
    let Some(request) = request else {
        let job = crate::plan::plan(&train_args, cfg, &data, world)?;
        crate::run_dir::write_run_files(&job.spec().config.out, &train_args, &job)?;
        return Ok(Offer::Settings(encode(&Settings::Train(Box::new(job)))?));
    };
    eprintln!(
        "asking the {} other node(s) to time the model on their own hardware (up to {} s each; \
         --no-node-profile plans from this node's profile alone)",
        world - 1,
        args.job.profile_budget
    );
    let then: FromAnswers = Box::new(move |answers| {
        let profiles = answers.into_iter().enumerate().map(profile_of).collect();
        crate::plan::plan_with_profiles(&train_args, cfg, &data, world, profiles)
            .and_then(|job| {
                crate::run_dir::write_run_files(&job.spec().config.out, &train_args, &job)?;
                encode(&Settings::Train(Box::new(job)))
            })
            .map_err(|e| crate::error::describe(&e))
    });
    Ok(Offer::Ask {
        request: serde_json::to_string(&request).context("encoding the profile request")?,
        then,
    })
}

/// A node started by hand computes on its own machine's cores when the run's threads are a
/// default: rank 0 planned with its own, and another machine has its own count. The nodes
/// of the table at this node's address share this machine's cores (on one machine, as on
/// loopback, each takes its share, as the local launcher's nodes do).
fn own_threads(job: &mut Job, rank: u32, table: &ringtmp_cluster::rendezvous::Table) {
    if !job.spec().config.threads_from_machine {
        return;
    }
    let ip = |r: u32| table.addr(r).ok().map(|a| a.ip());
    let Some(mine) = ip(rank) else { return };
    let here = table
        .nodes
        .iter()
        .filter(|n| ip(n.rank) == Some(mine))
        .count();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    job.spec_mut().config.threads = (cores / here.max(1)).max(1);
}

/// Rank `rank`'s profile from its answer at rendezvous; a node that could not profile is
/// planned from rank 0's profile, with a warning saying why.
fn profile_of((rank, answer): (usize, Option<String>)) -> Option<node_profile::NodeProfile> {
    match node_profile::parse_reply(&answer?) {
        ProfileReply::Measured(profile) => Some(profile),
        ProfileReply::Failed(why) => {
            eprintln!(
                "WARNING: node {rank} could not time the model ({why}); it is planned from \
                 this node's profile"
            );
            None
        }
    }
}

/// What rank 0 has before rendezvous: the launcher's plan, or what to plan with.
enum Rank0Job {
    Planned(Box<Job>),
    Prepared(Box<Prepared>),
}

/// The options, configuration and data set a plan is made from.
struct Prepared {
    train_args: TrainArgs,
    cfg: ringtmp_strategy::TrainConfig,
    data: ringtmp_data::Dataset,
}

/// Rank 0's job: read from the local launcher's job file (the plan it printed), or prepared here
/// from the `--config` options under an external launcher.
fn rank0_job(args: &NodeArgs, world: u32) -> Result<Rank0Job> {
    if let Some(file) = &args.job.job_file {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let job: Job = serde_json::from_str(&text)
            .map_err(|e| UsageError(format!("{} is not a job file: {e}", file.display())))?;
        job.validate(world)
            .map_err(|e| UsageError(format!("{}: {e}", file.display())))?;
        return Ok(Rank0Job::Planned(Box::new(job)));
    }
    // The node's own flags over its options: where to resume, the world the launcher started,
    // the receive timeout of its links.
    let given = train_options(args)?;
    if let Some(n) = given.strategy.nodes
        && n != world
    {
        return Err(UsageError(format!(
            "the options say nodes = {n}, but the launcher started {world} nodes"
        ))
        .into());
    }
    let mut given = given;
    given.output.resume = args.job.resume.clone().or(given.output.resume);
    given.strategy.nodes = Some(world);
    given.faults.recv_timeout = given.faults.recv_timeout.or(args.connect.recv_timeout);
    given.check_applicable()?;
    let request = given.resolve()?;
    let train_args = request.options();
    let data = crate::plan::load_dataset(&train_args, true)?;
    let mut cfg = train_args.resolve_for(&data)?;
    let init = crate::init_from::convert(&train_args, &cfg, &data)?;
    if init.is_some() {
        cfg.init_from = Some(crate::init_from::init_dir(&cfg.out));
    }
    // Under an external launcher this is the first look at the output directory.
    crate::run_dir::prepare(&cfg.out, cfg.resume.as_deref(), request.overwrite())?;
    // Every node reads the weights from here: a directory every node sees, as --out must be.
    if let (Some(init), Some(dir)) = (&init, &cfg.init_from) {
        init.write(dir)?;
    }
    Ok(Rank0Job::Prepared(Box::new(Prepared {
        train_args: request.writing_to(cfg.out.clone()).options(),
        cfg,
        data,
    })))
}

/// Runs this node's part of a training job; the rank that returns the summary prints it.
/// Runs rank `rank` of a split generation; rank 0 prints the text as it is drawn (its standard
/// output passes through the local launcher as it comes) and the figures.
fn run_generation(
    job: &GenerateJob,
    rank: u32,
    net: &mut ringtmp_transport::Network,
) -> Result<()> {
    if rank != 0 {
        ringtmp_strategy::generate::run(job, rank, net, &mut |_| Ok(()))?;
        return Ok(());
    }
    let text = if job.pretrained {
        let opened = crate::pretrained::open(&job.checkpoint)?;
        crate::generate::Text::Pretrained(Box::new(opened.vocabulary.tokenizer))
    } else {
        let prompt_ids = Some(&job.prompt);
        crate::generate::open(&job.checkpoint, job.tokenizer.as_deref(), "", prompt_ids)?.text
    };
    let shown: &[u32] = if job.print_prompt { &job.prompt } else { &[] };
    let mut printer = crate::generate::Printer::new(&text, shown)?;
    let outcome = ringtmp_strategy::generate::run(job, rank, net, &mut |token| {
        printer
            .token(token)
            .map_err(|e| ringtmp_strategy::Error::Config(e.to_string()))
    })?;
    printer.end()?;
    if let Some((generated, cache)) = outcome {
        eprintln!(
            "{} (rank 0's cache)",
            crate::generate::figures(&generated, job.prompt.len(), cache)
        );
    }
    Ok(())
}

fn run_training(
    job: &Job,
    rank: u32,
    args: &NodeArgs,
    net: &mut ringtmp_transport::Network,
) -> Result<()> {
    let spec = job.spec();
    // A node started by hand says what it is for (under the local launcher the plan said it).
    let by_hand = std::env::var_os(crate::launcher::LOCAL_LAUNCHER_ENV).is_none();
    if by_hand && rank != 0 {
        eprintln!(
            "node: rank {rank} runs {}: {}; {} thread(s)",
            job.name(),
            job.role(rank),
            spec.threads
        );
    }
    crate::plan::init_threads(spec.threads)?;
    let data = if job.needs_data(rank) {
        let text = spec.text.as_ref();
        let train_args = TrainArgs {
            data: crate::args::DataArgs {
                dataset: Some(spec.dataset.clone()),
                data_dir: spec.data_dir.clone(),
                data_file: text.map(|t| t.files.clone()),
                seq_len: text.map(|t| t.seq_len),
                val_fraction: text.map(|t| t.validation),
                eval_tokens: text.map(|t| t.eval_tokens),
                vocab_size: text.map(|t| t.bin_vocab),
                tokenizer: text.and_then(|t| t.tokenizer.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        // Whoever planned the run announced its data (the local launcher, or rank 0 as it
        // prepared the job it offers): every node reading it again logs its own line only.
        let data = crate::plan::load_described(&train_args, spec.source.as_ref(), false)?;
        // The text this node read must be the text the run was planned on.
        let vocabulary = match &data.task {
            ringtmp_data::Task::NextToken { vocab, .. } => Some(vocab.to_line()),
            ringtmp_data::Task::Classify | ringtmp_data::Task::Regress => None,
        };
        if vocabulary != spec.vocabulary || ringtmp_strategy::sequence_of(&data) != spec.sequence {
            return Err(UsageError(format!(
                "rank {rank} read data unlike the run's: its text gives another vocabulary or \
                 window than the one rank 0 planned with (are the files the same on every node?)"
            ))
            .into());
        }
        Some(data)
    } else {
        None
    };
    // Rank 0 keeps the run's steps (the parameter server's server 0 counts its iterations): a
    // run in which it waits longer than the step bound for anything ends, naming every node's
    // wait.
    if rank == 0 {
        let peer_timeout = Duration::try_from_secs_f64(args.connect.peer_timeout)
            .unwrap_or(Duration::from_secs(5));
        let mut bound = ringtmp_transport::StepBound::new(peer_timeout, job.predicted_step());
        if let Some(floor) = spec.config.stall_timeout_secs {
            bound.floor = Duration::try_from_secs_f64(floor).unwrap_or(bound.floor);
        }
        net.watch_steps(bound);
    }
    let mut display =
        crate::display::Display::for_language_model(spec.sequence, spec.vocabulary.as_deref());
    let shows_progress = rank == job.progress_rank();
    // Progress from one rank; what a node handled and went on from, from every rank.
    let mut on_event = |e: &ringtmp_strategy::Event| {
        if shows_progress || matches!(e, ringtmp_strategy::Event::Notice { .. }) {
            display.event(e)
        }
    };
    let mut cx = NodeCx {
        net,
        data: data.as_ref(),
        on_event: &mut on_event,
    };
    let summary = job.run(rank, &mut cx)?;
    display.finish();
    if let Some(summary) = summary {
        crate::display::print_summary(&summary, &spec.out);
    } else if by_hand {
        eprintln!("node: rank {rank} done: its part of the run ended without a fault");
    }
    Ok(())
}

fn print_selftest(
    rank: u32,
    reports: &[ringtmp_strategy::selftest::NodeReport],
    size_mib: f64,
    rounds: u32,
    pings: u32,
) {
    if rank != 0 {
        return;
    }
    println!(
        "selftest ok: {} node(s), {rounds} round(s) of {size_mib} MiB, {pings} ping(s)",
        reports.len()
    );
    println!(
        "{:>4} {:>14} {:>14} {:>16}",
        "rank", "RTT p50 (µs)", "RTT p99 (µs)", "send (MB/s)"
    );
    for r in reports {
        println!(
            "{:>4} {:>14.1} {:>14.1} {:>16.1}",
            r.rank, r.rtt_p50_us, r.rtt_p99_us, r.send_mb_per_s
        );
    }
}

/// Restricts this process to one core.
pub fn pin_to_core(core: usize) -> Result<()> {
    // SAFETY: sched_setaffinity reads the set we initialise here and affects only this process.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(UsageError(format!(
            "cannot pin to core {core}: {}",
            std::io::Error::last_os_error()
        ))
        .into())
    }
}

/// Fault injection: `after` from now, the calling thread (the node's training) blocks for good
/// in a signal handler, while the I/O runtime's threads keep its links and heartbeats alive.
fn hang_main_thread_after(after: Duration) {
    extern "C" fn hang(_: libc::c_int) {
        loop {
            // SAFETY: pause(2) is async-signal-safe; it returns only when another signal
            // is handled, and this handler waits again.
            unsafe { libc::pause() };
        }
    }
    // SAFETY: pthread_self has no preconditions.
    let main = unsafe { libc::pthread_self() };
    // SAFETY: the handler only calls pause(2), which is async-signal-safe.
    unsafe { libc::signal(libc::SIGUSR2, hang as *const () as libc::sighandler_t) };
    std::thread::spawn(move || {
        std::thread::sleep(after);
        eprintln!("fault injection: the training thread hangs (links stay alive)");
        // SAFETY: `main` is this process's thread that called us, alive for the run.
        unsafe { libc::pthread_kill(main, libc::SIGUSR2) };
    });
}
