//! `ringtmp`: train neural networks across a ring of modest machines.
//!
//! The binary is thin: it parses options into validated configurations, loads the data, calls a
//! strategy from `ringtmp-strategy` and shows progress. Exit status: 0 on success, 1 when training
//! fails at run time, 2 for a usage, configuration or input-data error.

mod args;
mod bench;
mod bench_cores;
mod bench_transport;
mod cgroup;
mod compare;
mod display;
mod error;
mod export;
mod generate;
mod generate_pretrained;
mod init_from;
mod inspect;
mod launcher;
mod links;
mod node;
mod plan;
mod pretrained;
mod request;
mod restart;
mod run_dir;
mod simulate;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::{UsageError, describe, exit_code};

#[derive(Parser)]
#[command(
    name = "ringtmp",
    version,
    about = "Ring topological model-parallel training, and the strategies it is compared with"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (default: the mlp preset on the bundled MNIST).
    // Negative numbers parse as values, so `--batch-size -5` is reported as an invalid batch size.
    #[command(allow_negative_numbers = true)]
    Train(args::TrainArgs),
    /// Measure training throughput of the compute engine (samples/s per model and thread count).
    BenchCompute(bench::BenchArgs),
    /// Measure what this machine's CPUs cost each other when they compute at once (the ceiling
    /// of a ring of processes pinned one to a core).
    BenchCores(bench_cores::BenchCoresArgs),
    /// Measure the transport against plain TCP on loopback (throughput and round trips).
    BenchTransport(bench_transport::BenchTransportArgs),
    /// Generate text from a language model's checkpoint (any strategy's), token by token with a
    /// KV cache.
    Generate(generate::GenerateArgs),
    /// Write a checkpoint (any strategy's, any partition) as PyTorch's model.safetensors and a
    /// model.py that rebuilds the module.
    Export(export::ExportArgs),
    /// Run a checkpoint's model on your inputs (a table, arrays, images), read as training read
    /// them, and write its outputs (.npy or .csv).
    Predict(export::PredictArgs),
    /// Score a checkpoint's weights on labelled inputs without training (accuracy; R², RMSE
    /// and MAE for a regression).
    Eval(export::EvalArgs),
    /// Check training options or a model file without training.
    ValidateConfig(args::TrainArgs),
    /// Describe a pretrained model's GGUF file or Hugging Face directory: architecture,
    /// parameters, tensor types, memory, tokenizer.
    Inspect(inspect::InspectArgs),
    /// Join a run started elsewhere (mpirun, srun, torchrun, Kubernetes, or by hand).
    Node(node::NodeArgs),
    /// Check connectivity and measure the links of a local ring of N node processes.
    Selftest(SelftestArgs),
    /// Predict what `train` would do on a cluster this machine does not have: the strategies'
    /// own code on a simulated network, compute priced by a cost model, tensors as sizes.
    Simulate(simulate::SimulateArgs),
    /// Run several strategies one after the other on the same model, data and emulated cluster,
    /// and write a side-by-side report (`ringtmp compare --help`).
    #[command(disable_help_flag = true)]
    Compare {
        /// compare's options, then `ringtmp train` options shared by every run.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// `ringtmp selftest` options.
#[derive(clap::Args)]
struct SelftestArgs {
    /// Local node processes to start.
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// Pin each node to its own core (when there are enough cores).
    #[arg(long)]
    pin: bool,
    #[command(flatten)]
    job: node::JobArgs,
    /// Every node's emulated card.
    #[command(flatten)]
    card: links::CardArgs,
    /// Send frames in the clear after the authenticated greeting (encrypted by default).
    #[arg(long)]
    insecure_plaintext: bool,
    /// Fault injection for tests: this rank exits abruptly after --crash-after-ms.
    #[arg(long, hide = true)]
    crash_rank: Option<u32>,
    /// Fault injection for tests: milliseconds before the crash.
    #[arg(long, hide = true, default_value_t = 1000)]
    crash_after_ms: u64,
}

fn selftest(a: &SelftestArgs) -> anyhow::Result<()> {
    if a.nodes < 2 {
        return Err(UsageError("--nodes must be at least 2".into()).into());
    }
    let card = a.card.card()?;
    launcher::launch(a.nodes, a.pin, |rank| {
        let mut args = vec![
            "--job".to_string(),
            "selftest".into(),
            "--size-mib".into(),
            a.job.size_mib.to_string(),
            "--rounds".into(),
            a.job.rounds.to_string(),
            "--pings".into(),
            a.job.pings.to_string(),
        ];
        args.extend(card.to_args());
        if a.crash_rank == Some(rank) {
            args.extend(["--crash-after-ms".into(), a.crash_after_ms.to_string()]);
        }
        if a.insecure_plaintext {
            args.push("--insecure-plaintext".into());
        }
        args
    })?;
    // Pinned nodes ran on cores 0..nodes (the launcher pins rank r to core r where there are
    // enough): whether those cores slow each other down is the other half of a ring's fitness.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if a.pin && a.crash_rank.is_none() && a.nodes as usize <= cores {
        let cpus: Vec<usize> = (0..a.nodes as usize).collect();
        // A note, not a failure: the links' test above is what selftest answers for.
        match bench_cores::selftest_line(&cpus) {
            Ok(lines) => lines.iter().for_each(|l| println!("[selftest] {l}")),
            Err(e) => println!("[selftest] cores {cpus:?} not measured: {e:#}"),
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs (refused peers, bound addresses) go to stderr; RINGTMP_LOG overrides the level. A
    // benchmark's own links would log every connection among its results: warnings only there.
    let level = match cli.command {
        Command::BenchTransport(_) => "warn",
        _ => "info",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("RINGTMP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let result = match cli.command {
        Command::Train(a) => train::run(&a),
        Command::BenchCompute(a) => bench::run(&a),
        Command::BenchCores(a) => bench_cores::run(&a),
        Command::ValidateConfig(a) => train::validate(&a),
        Command::Inspect(a) => inspect::run(&a),
        Command::Generate(a) => match &a.pretrained {
            Some(path) => generate_pretrained::run(&a, path),
            None => generate::run(&a),
        },
        Command::Export(a) => export::export(&a),
        Command::Predict(a) => export::predict(&a),
        Command::Eval(a) => export::eval(&a),
        Command::Node(a) => node::run(&a),
        Command::BenchTransport(a) => bench_transport::run(&a),
        Command::Selftest(a) => selftest(&a),
        Command::Compare { args } => compare::run(&args),
        Command::Simulate(a) => simulate::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", describe(&err));
            ExitCode::from(exit_code(&err))
        }
    }
}
