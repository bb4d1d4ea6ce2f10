//! What a node's machine offers: the memory the process may still use (read from the operating
//! system), and a node's measured profile ([`NodeProfile`]: its layer times, memory, links and
//! cores), which every node may send at rendezvous and a [`crate::Cluster`] carries to the
//! planners. Shared by the planner's profile, the rendezvous profile, and the CLI's core
//! benchmark.

use ringtmp_model::{ModelSpec, OptimizerConfig};
use serde::{Deserialize, Serialize};

/// Memory this process may still use: `MemAvailable` from `/proc/meminfo`, lowered to its
/// cgroup's limit less its usage (v2 `memory.max`, v1 `memory.limit_in_bytes`) when that is
/// smaller. `None` where neither can be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
                .map(|kb| kb * 1024)
        });
    let read = |path: &str| -> Option<u64> {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .zip(read("/sys/fs/cgroup/memory.current"))
        .or_else(|| {
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
                .zip(read("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
        })
        // v1 says "no limit" with a huge number.
        .filter(|(limit, _)| *limit < 1 << 60)
        .map(|(limit, used)| limit.saturating_sub(used));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One layer's measured times.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerTiming {
    /// Forward + backward of one micro-batch, seconds (lower quartile of the runs).
    pub compute_seconds: f64,
    /// One optimizer step over the layer's parameters, seconds (lower quartile of the runs).
    pub step_seconds: f64,
    /// Of `compute_seconds`, the part a split backward runs after it has handed out the
    /// layer's input gradient (a linear layer's weight gradient; lower quartile of the runs). 0
    /// for a layer that makes no input gradient, and in profiles from before it was measured.
    #[serde(default)]
    pub after_send_seconds: f64,
    /// Bytes the layer stashes per micro-batch beyond its input (outputs and side data).
    pub stash_bytes: u64,
    /// Bytes an evaluation pass of one micro-batch through the layer holds (its input, its
    /// output and its side data; 0 in profiles from before it was measured).
    #[serde(default)]
    pub eval_bytes: u64,
}

/// A node's measurements.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeProfile {
    /// What the node is: CPU model, SIMD level, cores (`AMD EPYC, avx512, 2 cores`).
    pub machine: String,
    /// Rows per micro-batch it was timed at.
    pub rows: usize,
    /// Compute threads it was timed with.
    pub threads: usize,
    /// One timing per layer of the model.
    pub layers: Vec<LayerTiming>,
    /// Memory the node can still use, bytes (`MemAvailable`, or its cgroup's limit less its
    /// usage when lower); `None` where it cannot tell.
    pub available_memory: Option<u64>,
    /// Seconds the measurement took (0 when it came from the cache).
    pub took_seconds: f64,
    /// Whether it came from the node's cache.
    #[serde(default)]
    pub cached: bool,
    /// The node's own network card as it knows it (its emulated card, `--bandwidth-mbit` on
    /// its command line), Mbit/s; `None` when not known.
    #[serde(default)]
    pub card_mbit: Option<f64>,
    /// One-way latency its links add (`--latency-ms` on its command line), ms.
    #[serde(default)]
    pub latency_ms: f64,
    /// CPU seconds per byte its links cost it (framing, and sealing and opening records on a
    /// private link; sending and receiving counted), measured with frames of its largest
    /// activation; `None` where the measurement failed.
    #[serde(default)]
    pub link_seconds_per_byte: Option<f64>,
    /// Cores this process may run on.
    #[serde(default)]
    pub cores: usize,
}

impl NodeProfile {
    /// Seconds per micro-batch of layers `i..j`, with `steps_per_micro_batch` optimizer steps.
    pub fn seconds(&self, steps_per_micro_batch: f64) -> Vec<f64> {
        self.layers
            .iter()
            .map(|t| t.compute_seconds + t.step_seconds * steps_per_micro_batch)
            .collect()
    }
}

/// What rank 0 asks every node to time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileRequest {
    /// The model.
    pub model: ModelSpec,
    /// Input shape of one example (height, width, channels).
    pub input: (usize, usize, usize),
    /// Classes of the data set.
    pub classes: usize,
    /// A language model's positions per window (`None` for a classifier).
    #[serde(default)]
    pub sequence: Option<usize>,
    /// The optimizer (its step is timed per layer).
    pub optimizer: OptimizerConfig,
    /// Rows per micro-batch.
    pub rows: usize,
    /// Compute threads each node runs with.
    pub threads: usize,
    /// Seconds the timed runs may take in all, after one warm-up run per layer.
    pub budget_seconds: f64,
}

/// What the operating system says of this node's process, for its summary.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessReadings {
    /// Peak resident set size, bytes.
    pub peak_rss_bytes: u64,
    /// CPU seconds, user and system.
    pub cpu_seconds: f64,
    /// The hypervisor's steal on the node's own cores, where it pinned itself.
    pub steal_seconds: Option<f64>,
    /// Time its CPU quota held it off the CPU, where it has one.
    pub throttled_seconds: Option<f64>,
}

impl ProcessReadings {
    /// This process's readings — or none under a virtual `clock`: there the process is the
    /// simulator's, shared by every simulated node, and a summary travels the simulated wire,
    /// where the length of its figures would make the simulated time depend on the machine's
    /// load.
    pub fn of(clock: &dyn ringtmp_transport::Clock) -> Self {
        use ringtmp_metrics::resources;
        if clock.is_virtual() {
            return Self::default();
        }
        Self {
            peak_rss_bytes: resources::peak_rss_bytes().unwrap_or(0),
            cpu_seconds: resources::cpu_seconds(),
            steal_seconds: resources::steal_seconds(),
            throttled_seconds: resources::quota_throttled_seconds(),
        }
    }
}

/// The CPU's model name from `/proc/cpuinfo` with its family and model numbers where the file
/// gives them ("AMD EPYC (family 25 model 17)"), or `unknown`. Under a hypervisor the name alone
/// can be as bare as "AMD EPYC" for CPUs generations apart (a Zen 4 with AVX-512 on half-width
/// units, a Zen 5 with full-width ones), and what is keyed by the machine (stored compute
/// baselines, cached node profiles) must tell them apart.
pub fn machine_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|text| machine_name_from_cpuinfo(&text))
        .unwrap_or_else(|_| "unknown".into())
}

/// `machine_name` of a `/proc/cpuinfo` text: its first processor's fields (x86's `model name`,
/// `cpu family`, `model`; ARM's `CPU implementer`, `CPU part`).
pub fn machine_name_from_cpuinfo(text: &str) -> String {
    let field = |key: &str| {
        text.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim() == key)
            .map(|(_, v)| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let name = field("model name");
    let signature = match (field("cpu family"), field("model")) {
        (Some(family), Some(model)) => Some(format!("family {family} model {model}")),
        _ => match (field("CPU implementer"), field("CPU part")) {
            (Some(implementer), Some(part)) => {
                Some(format!("implementer {implementer} part {part}"))
            }
            _ => None,
        },
    };
    match (name, signature) {
        (Some(name), Some(signature)) => format!("{name} ({signature})"),
        (Some(name), None) => name,
        (None, Some(signature)) => signature,
        (None, None) => "unknown".into(),
    }
}
