//! `ringtmp bench-cores`: what the CPUs of this machine cost each other when they compute at
//! once — the ceiling of a ring of processes pinned one to a core, before any ring runs.
//!
//! A ring of N nodes pinned to N cores can only be N× one core if each core computes as fast
//! beside the others as alone. On a virtual machine that is not a given: two vCPUs listed as two
//! cores may be hyperthreads of one physical core on the host (they then share its arithmetic
//! units and caches), a CPU may clock down with more cores busy, and cores share the memory
//! bandwidth. Each of three probes runs on every given CPU alone in turn, then on all of them at
//! once, in alternating rounds, and reports each CPU's rate together over its rate alone:
//!
//! - *arithmetic*: a 64×64×64 GEMM over and over (its operands stay in the core's L1/L2): falls
//!   well below 1 only where cores share execution units (SMT siblings on the host, or one core
//!   time-sliced — the steal printed beside it tells which) or clock down together;
//! - *ring stage*: a ring node's work, the training step (forward, backward with the input
//!   gradient, SGD-momentum update) of `mlp-deep`'s second stage on two nodes (four 1024×1024
//!   layers and the output layer, 64 rows; 17 MB of weights and 17 MB of momentum);
//! - *memory*: copying a buffer of twice the last-level cache (at least 64 MiB) to another (read
//!   plus written bytes counted), so that it streams from memory on a machine with a large L3.
//!
//! Invariants: every thread is pinned to its CPU before it allocates or warms up; the timed parts
//! of one phase start together (a barrier) and each thread's rate is its own work over its own
//! time, so a thread that started late is not charged the others' time.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use crate::error::UsageError;
use anyhow::{Context, Result};
use clap::Args;
use ringtmp_model::{Layer, ModelSpec, Optimizer, OptimizerConfig, Pass, Shape, Stage, kernels};
use serde_json::json;

/// `ringtmp bench-cores` options.
#[derive(Args, Clone, Debug)]
pub struct BenchCoresArgs {
    /// CPUs to measure, comma-separated (at least two) [default: every CPU this process may run
    /// on].
    #[arg(long, value_delimiter = ',')]
    pub cpus: Vec<usize>,
    /// Seconds each probe runs in each phase.
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Rounds of (each CPU alone in turn, then all together) per probe; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
}

/// Below this, together over alone, a probe's line says the CPUs hold each other back.
const SHARED_BELOW: f64 = 0.75;

/// One of the workloads timed alone and together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    Arithmetic,
    RingStage,
    Memory,
}

impl Probe {
    const ALL: [Probe; 3] = [Probe::Arithmetic, Probe::RingStage, Probe::Memory];

    fn name(self) -> &'static str {
        match self {
            Probe::Arithmetic => "arithmetic",
            Probe::RingStage => "ring stage",
            Probe::Memory => "memory",
        }
    }

    fn what(self, setup: &Setup) -> String {
        match self {
            Probe::Arithmetic => "64³ GEMM, operands in L1/L2".into(),
            Probe::RingStage => "mlp-deep's 2nd of 2 stages, 64 rows".into(),
            Probe::Memory => format!("{} MiB copy", (setup.copy_floats * 4) >> 20),
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Probe::Arithmetic => "GFLOP/s",
            Probe::RingStage => "steps/s",
            Probe::Memory => "GB/s",
        }
    }
}

/// A probe's buffers on one thread, built after the thread is pinned (so its pages are first
/// touched, and its caches warmed, where it runs).
enum Work {
    Arithmetic {
        a: Vec<f32>,
        b: Vec<f32>,
        c: Vec<f32>,
    },
    RingStage(Box<StageStep>),
    Memory {
        from: Vec<f32>,
        to: Vec<f32>,
    },
}

const GEMM_N: usize = 64;
const ROWS: usize = 64;
/// `mlp-deep` on two nodes is cut before this layer (as the planner cuts it).
const CUT: usize = 9;

/// A ring stage's training step, with its optimizer and inputs.
struct StageStep {
    stage: Stage,
    optimizer: Optimizer,
    x: Vec<f32>,
    dy: Vec<f32>,
    id: u64,
}

impl StageStep {
    fn new(layers: &[Layer]) -> Self {
        let range = CUT..layers.len();
        let (first, last) = (&layers[range.start], &layers[range.end - 1]);
        let mut stage = Stage::new(layers, range, 1, 1);
        stage.set_input_grad(true);
        let config = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let optimizer = Optimizer::new(config, stage.params().len());
        let x = (0..ROWS * first.input.numel())
            .map(|i| (i % 17) as f32 * 0.01)
            .collect();
        let dy = vec![1e-4; ROWS * last.output.numel()];
        Self {
            stage,
            optimizer,
            x,
            dy,
            id: 0,
        }
    }

    fn step(&mut self) -> Result<()> {
        let pass = Pass {
            train: true,
            seed: 1,
            step: self.id,
            row_offset: 0,
        };
        self.stage.forward(self.id, &self.x, ROWS, &pass)?;
        self.stage
            .backward_and_step(self.id, &self.dy, &mut self.optimizer, 1e-4, &mut || {})?;
        self.id += 1;
        Ok(())
    }
}

/// What every probe thread builds its work from.
struct Setup {
    /// `mlp-deep`'s layers (the ring stage probe takes its second stage on two nodes).
    layers: Vec<Layer>,
    /// Floats in each of the memory probe's two buffers: twice the last-level cache, so that the
    /// copy streams from memory rather than from the cache (a Xeon of this project's machines
    /// lists 300 MB of L3), at least 64 MiB, and small enough that every thread's two buffers
    /// take at most half of the memory available.
    copy_floats: usize,
}

impl Setup {
    fn new(threads: usize) -> Result<Self> {
        let layers = ModelSpec::preset("mlp-deep", 10)?
            .build(&Shape::flat(784), 10)
            .context("mlp-deep")?;
        let last_level = last_level_cache_bytes().unwrap_or(32 << 20);
        let wanted = (2 * last_level).max(64 << 20);
        let room = ringtmp_strategy::machine::available_memory().map_or(usize::MAX, |b| {
            usize::try_from(b).unwrap_or(usize::MAX) / (4 * threads.max(1))
        });
        let bytes = wanted.min(room).max(16 << 20);
        Ok(Self {
            layers,
            copy_floats: bytes / std::mem::size_of::<f32>(),
        })
    }
}

/// The size of the largest cache level CPU 0 lists (`/sys/devices/system/cpu/cpu0/cache`).
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|entry| {
        let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
        parse_cache_size(size.trim())
    })
    .max()
}

/// "32768K", "300M" or "1024" (bytes) as bytes.
fn parse_cache_size(text: &str) -> Option<usize> {
    let (digits, unit) = match text.chars().last()? {
        'K' => (&text[..text.len() - 1], 1 << 10),
        'M' => (&text[..text.len() - 1], 1 << 20),
        'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

impl Work {
    fn new(probe: Probe, setup: &Setup) -> Self {
        match probe {
            Probe::Arithmetic => Work::Arithmetic {
                a: (0..GEMM_N * GEMM_N)
                    .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
                    .collect(),
                b: (0..GEMM_N * GEMM_N)
                    .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
                    .collect(),
                c: vec![0.0; GEMM_N * GEMM_N],
            },
            Probe::RingStage => Work::RingStage(Box::new(StageStep::new(&setup.layers))),
            Probe::Memory => Work::Memory {
                from: (0..setup.copy_floats).map(|i| (i % 251) as f32).collect(),
                to: vec![0.0; setup.copy_floats],
            },
        }
    }

    /// Does one unit of work; returns what it counts for in the probe's unit (times 1e9).
    fn unit(&mut self) -> Result<f64> {
        Ok(match self {
            Work::Arithmetic { a, b, c } => {
                kernels::matmul(
                    c,
                    GEMM_N,
                    GEMM_N,
                    GEMM_N,
                    a,
                    kernels::Op::N,
                    b,
                    kernels::Op::N,
                    false,
                    1,
                );
                2.0 * (GEMM_N * GEMM_N * GEMM_N) as f64
            }
            Work::RingStage(step) => {
                step.step()?;
                1e9
            }
            Work::Memory { from, to } => {
                to.copy_from_slice(from);
                // Reads and writes; keep the copy from being elided.
                std::hint::black_box(&to);
                (2 * to.len() * std::mem::size_of::<f32>()) as f64
            }
        })
    }
}

/// Runs `probe` on each of `cpus` at once (one pinned thread each) for `seconds`; returns each
/// CPU's rate in the probe's unit.
fn phase(probe: Probe, cpus: &[usize], seconds: f64, setup: &Arc<Setup>) -> Result<Vec<f64>> {
    let barrier = Arc::new(Barrier::new(cpus.len()));
    let threads: Vec<_> = cpus
        .iter()
        .map(|&cpu| {
            let barrier = Arc::clone(&barrier);
            let setup = Arc::clone(setup);
            std::thread::Builder::new()
                .name(format!("probe-cpu{cpu}"))
                .spawn(move || -> Result<f64> {
                    // Every thread must reach the barrier, or the others wait forever: errors
                    // are kept until after it.
                    let ready = crate::node::pin_to_core(cpu).map(|()| {
                        kernels::flush_denormals();
                        let mut work = Work::new(probe, &setup);
                        work.unit().map(|_| work)
                    });
                    barrier.wait();
                    let mut work = ready??;
                    let started = Instant::now();
                    let mut done = 0.0;
                    while started.elapsed().as_secs_f64() < seconds {
                        done += work.unit()?;
                    }
                    Ok(done / 1e9 / started.elapsed().as_secs_f64())
                })
                .context("starting a probe thread")
        })
        .collect::<Result<_>>()?;
    threads
        .into_iter()
        .map(|t| {
            t.join()
                .map_err(|_| anyhow::anyhow!("a probe thread panicked"))?
        })
        .collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One probe's medians per CPU: alone and with all the others computing.
#[derive(Clone, Debug, PartialEq)]
struct ProbeResult {
    probe: Probe,
    alone: Vec<f64>,
    together: Vec<f64>,
}

impl ProbeResult {
    /// Each CPU's rate together over alone.
    fn ratios(&self) -> Vec<f64> {
        self.together
            .iter()
            .zip(&self.alone)
            .map(|(t, a)| t / a)
            .collect()
    }

    /// The slowest CPU's ratio: in a pipeline the slowest stage sets the pace.
    fn worst_ratio(&self) -> f64 {
        self.ratios().into_iter().fold(f64::INFINITY, f64::min)
    }
}

/// What the results say about a ring of processes pinned to these CPUs, a line each.
fn verdict(results: &[ProbeResult], cpus: &[usize], steal: Option<f64>) -> Vec<String> {
    let n = cpus.len();
    let list = cpus
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut lines = Vec::new();
    let ratio_of = |p: Probe| {
        results
            .iter()
            .find(|r| r.probe == p)
            .map(|r| r.worst_ratio())
    };
    if let Some(stage) = ratio_of(Probe::RingStage) {
        lines.push(format!(
            "{n} ring nodes pinned to CPUs {list} compute at {stage:.2}× their speed alone (the \
             slowest CPU): a perfectly balanced ring of {n} there tops out at {:.2}× one core, \
             before its cut's balance and the links",
            n as f64 * stage
        ));
    }
    if let Some(arith) = ratio_of(Probe::Arithmetic).filter(|&r| r < SHARED_BELOW) {
        let steal = steal.map_or(String::new(), |s| {
            format!(" (steal while together: {s:.2} s)")
        });
        lines.push(format!(
            "arithmetic together runs at {arith:.2}× alone: these CPUs share one core's \
             execution units — hyperthreads of one physical core on the host however the guest \
             lists them, or one core time-sliced between them{steal}; processes pinned to them \
             will not come near {n}× one"
        ));
    }
    if let Some(memory) = ratio_of(Probe::Memory).filter(|&r| r < SHARED_BELOW) {
        let stage = ratio_of(Probe::RingStage).map_or(String::new(), |s| {
            format!(" (the ring stage probe, which reads its 17 MB of weights and 17 MB of momentum every step, ran at {s:.2}×)")
        });
        lines.push(format!(
            "memory bandwidth together is {memory:.2}× alone per CPU: stages bound by memory \
             rather than arithmetic slow each other down{stage}"
        ));
    }
    lines
}

/// Every probe's medians on `cpus`, and the steal while they ran together.
struct Measured {
    results: Vec<ProbeResult>,
    /// Steal on `cpus` during the together phases; `None` where `/proc/stat` has no figure.
    steal_together: Option<f64>,
    together_seconds: f64,
}

/// Runs every probe on `cpus` (validated: distinct, allowed) for `rounds` rounds of `seconds`.
fn measure(cpus: &[usize], seconds: f64, rounds: usize, setup: &Arc<Setup>) -> Result<Measured> {
    let mut results = Vec::new();
    let mut steal_together = Some(0.0);
    let mut together_seconds = 0.0;
    for probe in Probe::ALL {
        let mut alone = vec![Vec::new(); cpus.len()];
        let mut together = vec![Vec::new(); cpus.len()];
        for _ in 0..rounds {
            for (k, &cpu) in cpus.iter().enumerate() {
                alone[k].extend(phase(probe, &[cpu], seconds, setup)?);
            }
            let before = ringtmp_metrics::resources::cores_steal_seconds(cpus);
            let rates = phase(probe, cpus, seconds, setup)?;
            let after = ringtmp_metrics::resources::cores_steal_seconds(cpus);
            steal_together = match (steal_together, before, after) {
                (Some(s), Some(b), Some(a)) => Some(s + (a - b).max(0.0)),
                _ => None,
            };
            together_seconds += seconds;
            for (k, rate) in rates.into_iter().enumerate() {
                together[k].push(rate);
            }
        }
        results.push(ProbeResult {
            probe,
            alone: alone.iter_mut().map(|v| median(v)).collect(),
            together: together.iter_mut().map(|v| median(v)).collect(),
        });
    }
    Ok(Measured {
        results,
        steal_together,
        together_seconds,
    })
}

/// `selftest --pin`'s short look at the cores its nodes were pinned to (one round of 0.2 s per
/// probe, a few seconds in all): one line of ratios and the verdict's lines.
pub fn selftest_line(cpus: &[usize]) -> Result<Vec<String>> {
    let m = measure(cpus, 0.2, 1, &Arc::new(Setup::new(cpus.len())?))?;
    let ratio = |p: Probe| {
        m.results
            .iter()
            .find(|r| r.probe == p)
            .map_or(f64::NAN, ProbeResult::worst_ratio)
    };
    let mut lines = vec![format!(
        "cores {cpus:?} computing at once, each against alone (slowest): arithmetic {:.2}×, ring \
         stage {:.2}×, memory {:.2}× (`ringtmp bench-cores` measures longer)",
        ratio(Probe::Arithmetic),
        ratio(Probe::RingStage),
        ratio(Probe::Memory)
    )];
    lines.extend(verdict(&m.results, cpus, m.steal_together));
    Ok(lines)
}

/// Runs the probes and prints a table and the verdict.
pub fn run(args: &BenchCoresArgs) -> Result<()> {
    let allowed = ringtmp_metrics::resources::allowed_cores();
    let cpus = if args.cpus.is_empty() {
        allowed.clone()
    } else {
        args.cpus.clone()
    };
    if let Some(bad) = cpus.iter().find(|c| !allowed.contains(c)) {
        return Err(UsageError(format!(
            "--cpus: this process may not run on CPU {bad} (it may on {allowed:?})"
        ))
        .into());
    }
    let mut distinct = cpus.clone();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() != cpus.len() || cpus.len() < 2 {
        return Err(UsageError(format!(
            "bench-cores needs at least two distinct CPUs (got {cpus:?}; this process may run \
             on {allowed:?})"
        ))
        .into());
    }
    if !(args.seconds > 0.0 && args.seconds.is_finite()) || args.rounds == 0 {
        return Err(UsageError("--seconds must be above 0 and --rounds at least 1".into()).into());
    }
    let setup = Arc::new(Setup::new(cpus.len())?);
    // Each round: every CPU alone, then all together, for each probe.
    let estimate = (Probe::ALL.len() * args.rounds * (cpus.len() + 1)) as f64 * args.seconds;
    println!(
        "machine: {}; SIMD: {}; CPUs {cpus:?}; {} round(s) of {} s per probe: each CPU alone in \
         turn, then all together (about {estimate:.0} s)",
        ringtmp_strategy::simulate::machine_name(),
        kernels::simd_level(),
        args.rounds,
        args.seconds
    );
    let Measured {
        results,
        steal_together,
        together_seconds,
    } = measure(&cpus, args.seconds, args.rounds, &setup)?;
    print_table(&results, &cpus, &setup);
    match steal_together {
        Some(s) => println!(
            "steal on these CPUs while together: {s:.2} s in {together_seconds:.1} s of \
             probing (time the hypervisor ran something else on them)"
        ),
        None => println!("steal: not readable here (/proc/stat)"),
    }
    for line in verdict(&results, &cpus, steal_together) {
        println!("=> {line}");
    }
    if let Some(path) = &args.json {
        let probes: Vec<_> = results
            .iter()
            .map(|r| {
                json!({"probe": r.probe.name(), "what": r.probe.what(&setup), "unit": r.probe.unit(),
                    "alone": r.alone, "together": r.together, "together_over_alone": r.ratios()})
            })
            .collect();
        let report = json!({"machine": ringtmp_strategy::simulate::machine_name(),
            "simd": kernels::simd_level(), "cpus": cpus, "seconds": args.seconds,
            "rounds": args.rounds, "probes": probes, "steal_seconds_together": steal_together,
            "verdict": verdict(&results, &cpus, steal_together)});
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn print_table(results: &[ProbeResult], cpus: &[usize], setup: &Setup) {
    println!(
        "{:<11} {:<36} {:>8} {:>4} {:>8} {:>9} {:>15}",
        "probe", "work", "unit", "cpu", "alone", "together", "together/alone"
    );
    for r in results {
        for (k, cpu) in cpus.iter().enumerate() {
            let (label, what, unit) = if k == 0 {
                (r.probe.name(), r.probe.what(setup), r.probe.unit())
            } else {
                ("", String::new(), "")
            };
            println!(
                "{label:<11} {what:<36} {unit:>8} {cpu:>4} {:>8.1} {:>9.1} {:>14.2}×",
                r.alone[k],
                r.together[k],
                r.together[k] / r.alone[k]
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(probe: Probe, alone: [f64; 2], together: [f64; 2]) -> ProbeResult {
        ProbeResult {
            probe,
            alone: alone.to_vec(),
            together: together.to_vec(),
        }
    }

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("300M"), Some(300 << 20));
        assert_eq!(parse_cache_size("1024"), Some(1024));
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("12Q"), None);
    }

    #[test]
    fn the_verdict_takes_the_slowest_cpu_and_names_shared_units_and_bandwidth() {
        // Whole cores: only the ceiling line, from the slower CPU (0.9 of alone, not 0.95).
        let whole = [
            result(Probe::Arithmetic, [50.0, 50.0], [49.0, 48.0]),
            result(Probe::RingStage, [100.0, 100.0], [95.0, 90.0]),
            result(Probe::Memory, [20.0, 20.0], [18.0, 17.0]),
        ];
        let lines = verdict(&whole, &[0, 1], Some(0.0));
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("0.90×") && lines[0].contains("1.80× one core"),
            "{lines:?}"
        );
        // Hyperthreads: arithmetic halves, and the memory is shared too.
        let siblings = [
            result(Probe::Arithmetic, [50.0, 50.0], [26.0, 25.0]),
            result(Probe::RingStage, [100.0, 100.0], [60.0, 58.0]),
            result(Probe::Memory, [20.0, 20.0], [11.0, 10.0]),
        ];
        let lines = verdict(&siblings, &[2, 3], Some(0.04));
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].contains("CPUs 2,3") && lines[0].contains("1.16× one core"));
        assert!(lines[1].contains("0.50×") && lines[1].contains("steal while together: 0.04 s"));
        assert!(lines[2].contains("0.50×") && lines[2].contains("ran at 0.58×"));
    }
}
