//! `ringtmp node`: join a run started elsewhere (by the local launcher, mpirun, srun, torchrun,
//! a Kubernetes indexed job, or by hand). Placement comes from flags or the launcher's environment;
//! every job setting comes from rank 0 at rendezvous, so nodes cannot disagree.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use ringtmp_cluster::launch::{LaunchFlags, resolve};
use ringtmp_cluster::node::{JoinOptions, join, ring_neighbours};
use ringtmp_strategy::selftest::{self, SelftestConfig};
use ringtmp_transport::{Shaping, TransportConfig};
use serde::{Deserialize, Serialize};

use crate::UsageError;
use crate::args::TrainArgs;
use crate::ring_setup::ring_job;
use ringtmp_cluster::node::star_neighbours;
use ringtmp_strategy::param_server::driver::PsJob;
use ringtmp_strategy::ring::driver::{MasterSetup, RingJob, run_master, run_worker};

/// What the nodes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Job {
    /// Connectivity check and link measurements around the ring.
    Selftest,
    /// Training with the options of `--config` (rank 0's file).
    Train,
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
    Train(Box<RingJob>),
    Ps(Box<PsJob>),
}

/// Job settings; rank 0's are handed to every node at rendezvous.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct JobArgs {
    /// The job.
    #[arg(long, value_enum, default_value = "selftest")]
    pub job: Job,
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
    /// Train: the job already planned (written by the local launcher); rank 0 only.
    #[arg(long, value_name = "FILE", hide = true)]
    #[serde(skip)]
    pub job_file: Option<PathBuf>,
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
    /// Seconds to wait for any one message before giving up.
    #[arg(long, default_value_t = 30.0)]
    pub recv_timeout: f64,
    /// Emulated bandwidth of every outgoing link, in Mbit/s.
    #[arg(long)]
    pub bandwidth_mbit: Option<f64>,
    /// Emulated one-way latency of every outgoing link, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub latency_ms: f64,
    /// Pin this process to one CPU core.
    #[arg(long)]
    pub cpu: Option<usize>,
    /// Fault injection for tests: exit abruptly (no goodbye) after this many milliseconds.
    #[arg(long, hide = true)]
    pub crash_after_ms: Option<u64>,
    /// Fault injection for tests: stop this process (SIGSTOP, as `kill -STOP` does) after this
    /// many milliseconds.
    #[arg(long, hide = true)]
    pub freeze_after_ms: Option<u64>,
}

/// `ringtmp node` options.
#[derive(Args, Clone, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    connect: ConnectArgs,
    #[command(flatten)]
    job: JobArgs,
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
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| UsageError(format!("--{name} must be a positive number of seconds")).into())
}

/// `ringtmp node`.
pub fn run(args: &NodeArgs) -> Result<()> {
    let c = &args.connect;
    if let Some(core) = c.cpu {
        pin_to_core(core)?;
    }
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
    let secret = secret(c)?;
    let mut transport = TransportConfig::new(0, placement.rank, secret.clone());
    transport.heartbeat_interval = Duration::from_millis(c.heartbeat_ms.max(1));
    transport.peer_timeout = seconds("peer-timeout", c.peer_timeout)?;
    transport.shaping = Shaping {
        bandwidth_bps: c
            .bandwidth_mbit
            .map(|m| (m * 1e6) as u64)
            .filter(|b| *b > 0),
        latency: Duration::try_from_secs_f64(c.latency_ms / 1e3)
            .map_err(|_| UsageError("--latency-ms must be ≥ 0".into()))?,
    };
    let options = JoinOptions {
        listen_host: c.listen.clone(),
        secret,
        connect_timeout: seconds("connect-timeout", c.connect_timeout)?,
        transport,
    };
    // Rank 0 decides what everybody runs; the others' job options are ignored.
    let mut master = None;
    let settings = if placement.rank == 0 {
        match args.job.job {
            Job::Selftest => Settings::Selftest {
                size_mib: args.job.size_mib,
                rounds: args.job.rounds,
                pings: args.job.pings,
            },
            Job::Train => {
                let path = args.job.config.clone().ok_or_else(|| {
                    UsageError("--job train needs --config FILE on rank 0".into())
                })?;
                let mut train_args = TrainArgs {
                    config: Some(path),
                    ..Default::default()
                }
                .merged()?;
                train_args.check_applicable()?;
                if let Some(n) = train_args.nodes
                    && n != placement.world_size
                {
                    return Err(UsageError(format!(
                        "the options say nodes = {n}, but the launcher started {} nodes",
                        placement.world_size
                    ))
                    .into());
                }
                train_args.nodes = Some(placement.world_size);
                train_args.adopt_checkpoint_batch()?;
                let data = crate::train::load_dataset(&train_args, args.job.job_file.is_none())?;
                let cfg = train_args.resolve(data.classes)?;
                // Plan with the output directory chosen here (the default one is time-stamped).
                train_args.out = Some(cfg.out.clone());
                if args.job.job_file.is_none() {
                    // Under an external launcher this is the first look at the directory (the
                    // local launcher has prepared it already).
                    crate::run_dir::prepare(
                        &cfg.out,
                        cfg.resume.as_deref(),
                        train_args.overwrite.unwrap_or(false),
                    )?;
                }
                let settings = match &args.job.job_file {
                    // Planned by the local launcher already (so the plan it printed is the one run).
                    Some(file) => {
                        let text = std::fs::read_to_string(file)
                            .with_context(|| format!("reading {}", file.display()))?;
                        serde_json::from_str(&text)
                            .with_context(|| format!("{} is not a job file", file.display()))?
                    }
                    None => plan_job(&train_args, &data, placement.world_size)?,
                };
                crate::train::init_threads(match &settings {
                    Settings::Train(job) => job.spec.threads,
                    Settings::Ps(job) => job.spec.threads,
                    Settings::Selftest { .. } => 1,
                })?;
                master = Some((data, cfg));
                settings
            }
        }
    } else {
        Settings::Selftest {
            size_mib: 0.0,
            rounds: 0,
            pings: 0,
        }
    };
    let settings = serde_json::to_string(&settings).context("encoding the job settings")?;
    let (table, mut net) =
        join(
            &placement,
            &options,
            settings,
            |rank, world, settings| match serde_json::from_str::<Settings>(settings) {
                Ok(Settings::Ps(job)) => star_neighbours(rank, world, job.servers as u32),
                _ => ring_neighbours(rank, world),
            },
        )?;
    let settings: Settings =
        serde_json::from_str(&table.settings).context("rank 0's job settings")?;
    let recv_timeout = seconds("recv-timeout", c.recv_timeout)?;
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
                timeout: recv_timeout,
            };
            selftest::run(&mut net, placement.world_size, table.run_id, cfg)
                .map(|reports| print_selftest(placement.rank, &reports, size_mib, rounds, pings))
                .map_err(Into::into)
        }
        Settings::Train(job) => match master {
            Some((data, cfg)) => {
                let setup = MasterSetup {
                    data: &data,
                    out: &cfg.out,
                    target_accuracy: cfg.target_accuracy,
                    eval_every: cfg.eval_every,
                };
                let mut display = crate::train::Display::new();
                let outcome = run_master(&job, &setup, &mut net, &mut |e| display.event(e));
                display.finish();
                outcome
                    .map(|o| crate::train::print_summary(&o.summary, &cfg.out))
                    .map_err(Into::into)
            }
            None => {
                crate::train::init_threads(job.spec.threads)?;
                run_worker(&job, &mut net).map(|_| ()).map_err(Into::into)
            }
        },
        Settings::Ps(job) => crate::ps_node::run(&job, placement.rank, master, &args.job, &mut net),
    };
    match result {
        Ok(()) => {
            net.close()?;
            Ok(())
        }
        Err(e) => {
            net.abort(&crate::describe(&e));
            Err(e)
        }
    }
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

/// Rank 0 without a launcher-made job file: plans the job its `--config` asks for.
pub(crate) fn plan_job(
    train_args: &TrainArgs,
    data: &ringtmp_data::Dataset,
    nodes: u32,
) -> Result<Settings> {
    Ok(match train_args.strategy() {
        crate::args::Strategy::Ps => Settings::Ps(Box::new(
            crate::ps_setup::ps_job(train_args, data, nodes)?.0,
        )),
        crate::args::Strategy::Ring => {
            Settings::Train(Box::new(ring_job(train_args, data, nodes)?.0))
        }
        crate::args::Strategy::Local => {
            return Err(
                UsageError("--strategy local runs in one process, not on nodes".into()).into(),
            );
        }
    })
}
