//! DiLoCo's job and options: what `ringtmp train --strategy diloco` takes, and what every worker
//! runs.

use serde::{Deserialize, Serialize};

use ringtmp_collective::outer::OuterConfig;
use ringtmp_contract::options_merge;
use ringtmp_contract::spec::RunSpec;

/// `--strategy` name.
pub const NAME: &str = "diloco";

/// Inner steps between two synchronisations of the language models (the DiLoCo paper's H).
pub const DEFAULT_INNER_STEPS_TEXT: u64 = 100;

/// Inner steps between two synchronisations of the image and table models: measured on `mlp`,
/// 4 workers, one epoch (docs/decisions/diloco.md: from H = 20 the accuracy is flat, below it
/// the outer momentum overshoots).
pub const DEFAULT_INNER_STEPS: u64 = 20;

/// What the pseudo-gradients travel as in the outer all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OuterDtype {
    /// IEEE binary32 (the paper's).
    F32,
    /// bfloat16: half the bytes, f32's range.
    Bf16,
    /// IEEE binary16: half the bytes, more mantissa, less range.
    F16,
    /// 8-bit integers with one scale per chunk (its largest magnitude ÷ 127): a quarter of the
    /// bytes; every hop of the reduce-scatter rounds its partial sum again.
    Int8,
}

impl OuterDtype {
    /// The wire type.
    pub fn wire(self) -> ringtmp_wire::Dtype {
        match self {
            Self::F32 => ringtmp_wire::Dtype::F32,
            Self::Bf16 => ringtmp_wire::Dtype::Bf16,
            Self::F16 => ringtmp_wire::Dtype::F16,
            Self::Int8 => ringtmp_wire::Dtype::I8,
        }
    }
}

/// How the outer step's size follows the inner learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OuterSchedule {
    /// The paper's: the outer rate is constant, and each pseudo-gradient enters the momentum as
    /// it is (it shrinks with the inner rate, the momentum gathered before does not).
    Constant,
    /// The outer step follows the inner schedule: pseudo-gradients enter the momentum in units
    /// of the peak inner rate, and the step applies it at the interval's mean rate.
    Inner,
}

/// `ringtmp train --strategy diloco` options (flags, and keys of a `--config` file).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(rename_all = "kebab-case")]
pub struct DilocoOptions {
    /// DiLoCo: inner steps between synchronisations, H [default: 100 for language models, 20
    /// otherwise].
    #[cfg_attr(feature = "cli", arg(long, value_name = "H"))]
    pub inner_steps: Option<u64>,
    /// DiLoCo: the outer optimizer's learning rate [default: 0.7].
    #[cfg_attr(feature = "cli", arg(long, value_name = "LR"))]
    pub outer_lr: Option<f32>,
    /// DiLoCo: the outer optimizer's momentum [default: 0.9].
    #[cfg_attr(feature = "cli", arg(long, value_name = "MU"))]
    pub outer_momentum: Option<f32>,
    /// DiLoCo: Nesterov momentum in the outer step [default: true].
    #[cfg_attr(feature = "cli", arg(long, num_args = 0..=1, default_missing_value = "true"))]
    pub outer_nesterov: Option<bool>,
    /// DiLoCo: whether the outer step follows the inner learning-rate schedule [default:
    /// constant].
    #[cfg_attr(feature = "cli", arg(long, value_enum))]
    pub outer_schedule: Option<OuterSchedule>,
    /// DiLoCo: the model's tensors in F fragments, synchronised in turn every H/F steps
    /// (Streaming DiLoCo) [default: 1].
    #[cfg_attr(feature = "cli", arg(long, value_name = "F"))]
    pub outer_fragments: Option<usize>,
    /// DiLoCo: inner steps a synchronisation overlaps before it is applied, τ (Streaming
    /// DiLoCo) [default: 1 with fragments, 0 without].
    #[cfg_attr(feature = "cli", arg(long, value_name = "TAU"))]
    pub outer_overlap: Option<u64>,
    /// DiLoCo: how much of its own parameters a fragment keeps when an overlapped
    /// synchronisation lands, α (θ ← α·own + (1 − α)·outer) [default: 0.5].
    #[cfg_attr(feature = "cli", arg(long, value_name = "ALPHA"))]
    pub outer_mix: Option<f32>,
    /// DiLoCo: what the pseudo-gradients travel as [default: f32].
    #[cfg_attr(feature = "cli", arg(long, value_enum))]
    pub outer_dtype: Option<OuterDtype>,
    /// DiLoCo: seconds of inner steps a worker may spend between two synchronisations of a
    /// fragment; a slower worker skips to the synchronisation [default: unbounded].
    #[cfg_attr(feature = "cli", arg(long, value_name = "SECONDS"))]
    pub inner_seconds: Option<f64>,
}

options_merge!(
    DilocoOptions,
    inner_steps,
    outer_lr,
    outer_momentum,
    outer_nesterov,
    outer_schedule,
    outer_fragments,
    outer_overlap,
    outer_mix,
    outer_dtype,
    inner_seconds
);

/// DiLoCo's job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DilocoJob {
    /// What every job shares; `batch_size` is one worker's share of each global batch, and the
    /// learning rate, schedule and optimizer are the inner ones.
    #[serde(flatten)]
    pub spec: RunSpec,
    /// Workers (every node is one).
    pub workers: usize,
    /// Inner steps between two synchronisations of a fragment.
    pub inner_steps: u64,
    /// The outer optimizer.
    pub outer: OuterConfig,
    /// Fragments synchronised in turn.
    pub fragments: usize,
    /// Inner steps a synchronisation overlaps before it lands (0: it blocks).
    pub overlap: u64,
    /// What an overlapped synchronisation keeps of a fragment's own parameters.
    pub mix: f32,
    /// What the pseudo-gradients travel as.
    pub outer_dtype: OuterDtype,
    /// Bound on the inner steps' seconds per H steps.
    pub inner_seconds: Option<f64>,
    /// Bytes per bucket of the outer all-reduce.
    pub bucket_bytes: usize,
    /// Emulated relative speed per rank.
    pub node_speeds: Vec<f64>,
}
