//! One shape for every strategy. A strategy is a folder under this crate and one line of the
//! strategy list below (its [`Job`] variant and its options, which the CLI flattens into
//! `ringtmp train` through [`StrategyOptions`]); it implements [`Strategy`]:
//! how to plan a job for N nodes, check one that arrived from a file or the network, which ranks
//! each rank links to, which ranks may die without ending the run, and how a rank runs.
//!
//! Everything strategies share (model, data, optimizer, schedule, steps, evaluation, checkpoints,
//! seed, output, timeouts) is in the job's [`RunSpec`]; what a node needs at run time (its
//! network, the data when its role reads it, where progress goes) is its [`NodeCx`].
//! `docs/architecture.md` ("Where to change what") walks through adding one.

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;
use serde::{Deserialize, Serialize};

use crate::allreduce::{AllReduceJob, AllReduceOptions};
use crate::config::TrainConfig;
use crate::contract::{Cluster, NoOptions, NodeCx, PlanReport, Strategy};
use crate::diloco::{DilocoJob, DilocoOptions};
use crate::gossip::{AdpsgdJob, DpsgdJob, DpsgdOptions};
use crate::local::LocalJob;
use crate::machine::ProfileRequest;
use crate::param_server::driver::PsJob;
use crate::param_server::plan::PsOptions;
use crate::ring::plan::RingOptions;
use crate::ring::run::driver::RingJob;
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::RunSpec;

/// The strategies, one line each: the `Job` variant, its job type, its `--strategy` name (the
/// job type's `Strategy::NAME`, checked by a test), and its options — the field of
/// [`StrategyOptions`], its type, and the heading its flags have in `ringtmp train --help`.
/// Adding a strategy is its folder and one line here.
macro_rules! strategies {
    ($(
        $(#[$doc:meta])*
        $variant:ident($job:ty) = $name:literal, $field:ident: $options:ty, $heading:literal;
    )*) => {
        /// Every strategy's job, tagged by the strategy's name (`job.json`, and what rank 0 hands
        /// every node at rendezvous).
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "strategy")]
        pub enum Job {
            $(
                $(#[$doc])*
                #[serde(rename = $name)]
                $variant($job),
            )*
        }

        /// Every strategy's options, as `ringtmp train` takes them (flags, and keys of a
        /// `--config` file), each strategy's under its own heading.
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        pub struct StrategyOptions {
            $(
                #[allow(missing_docs)]
                #[cfg_attr(feature = "cli", command(flatten, next_help_heading = $heading))]
                #[serde(flatten)]
                pub $field: $options,
            )*
        }

        impl StrategyOptions {
            /// These options, with `other`'s where these leave one unset.
            pub fn merged_over(&self, other: &Self) -> Self {
                Self { $($field: self.$field.merged_over(&other.$field),)* }
            }

            /// The flags set, by the strategy that owns them.
            pub fn given(&self) -> Vec<(&'static str, Vec<String>)> {
                vec![$(($name, self.$field.given()),)*]
            }
        }

        macro_rules! each {
            ($job_:expr, $j:ident => $body:expr) => {
                match $job_ {
                    $(Job::$variant($j) => $body,)*
                }
            };
        }

        impl Job {
            /// The names `--strategy` takes.
            pub const NAMES: &'static [&'static str] = &[$(<$job as Strategy>::NAME,)*];

            /// Plans strategy `name`'s job, saying in `report` what it chose.
            pub fn plan(
                name: &str,
                config: TrainConfig,
                options: &StrategyOptions,
                cluster: &Cluster,
                data: &Dataset,
                report: &mut PlanReport,
            ) -> Result<Self> {
                match name {
                    $(
                        <$job as Strategy>::NAME => {
                            if config.clip_grad_norm.is_some() && !<$job as Strategy>::CLIPS {
                                return Err(Self::does_not_clip(name));
                            }
                            Ok(Self::$variant(<$job as Strategy>::plan(
                                config,
                                &options.$field,
                                cluster,
                                data,
                                report,
                            )?))
                        }
                    )*
                    other => Err(Self::unknown(other)),
                }
            }

            /// See [`Strategy::workers`].
            pub fn workers(name: &str, options: &StrategyOptions, nodes: u32) -> Result<usize> {
                match name {
                    $(<$job as Strategy>::NAME => <$job as Strategy>::workers(&options.$field, nodes),)*
                    other => Err(Self::unknown(other)),
                }
            }

            /// See [`Strategy::profile_request`].
            pub fn profile_request(
                name: &str,
                config: TrainConfig,
                options: &StrategyOptions,
                cluster: &Cluster,
                data: &Dataset,
                budget_seconds: f64,
            ) -> Result<Option<ProfileRequest>> {
                match name {
                    $(<$job as Strategy>::NAME => <$job as Strategy>::profile_request(
                        config,
                        &options.$field,
                        cluster,
                        data,
                        budget_seconds,
                    ),)*
                    other => Err(Self::unknown(other)),
                }
            }

            /// The strategy's name.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => <$job as Strategy>::NAME,)*
                }
            }

            /// Whether strategy `name` clips gradients by the global norm (see
            /// [`Strategy::CLIPS`]).
            pub fn clips(name: &str) -> bool {
                match name {
                    $(<$job as Strategy>::NAME => <$job as Strategy>::CLIPS,)*
                    _ => false,
                }
            }

            /// The family of strategy `name` (see [`Strategy::FAMILY`]); `None` for a name
            /// that is not a strategy's.
            pub fn family(name: &str) -> Option<crate::contract::Family> {
                match name {
                    $(<$job as Strategy>::NAME => Some(<$job as Strategy>::FAMILY),)*
                    _ => None,
                }
            }

            /// The option strategy `name`'s short form sets, and its value's name (see
            /// [`Strategy::SHORT_FORM`]).
            pub fn short_form(name: &str) -> Option<(&'static str, &'static str)> {
                match name {
                    $(<$job as Strategy>::NAME => <$job as Strategy>::SHORT_FORM,)*
                    _ => None,
                }
            }

            /// The names as written in this list, for the test that they are the strategies'.
            #[doc(hidden)]
            pub const LISTED_NAMES: &'static [&'static str] = &[$($name,)*];
        }
    };
}

strategies! {
    /// One process trains the whole model: the oracle.
    Local(LocalJob) = "local", local: NoOptions, "Local (--strategy local)";
    /// RingTMP.
    Ring(RingJob) = "ring", ring: RingOptions, "Ring (--strategy ring)";
    /// The parameter server.
    Ps(PsJob) = "ps", ps: PsOptions, "Parameter server (--strategy ps)";
    /// Ring all-reduce SGD.
    AllReduce(AllReduceJob) = "allreduce", allreduce: AllReduceOptions,
        "All-reduce (--strategy allreduce)";
    /// D-PSGD.
    Dpsgd(DpsgdJob) = "dpsgd", dpsgd: DpsgdOptions, "D-PSGD and AD-PSGD (--strategy dpsgd, adpsgd)";
    /// AD-PSGD.
    Adpsgd(AdpsgdJob) = "adpsgd", adpsgd: NoOptions, "AD-PSGD (--strategy adpsgd)";
    /// DiLoCo.
    Diloco(DilocoJob) = "diloco", diloco: DilocoOptions, "DiLoCo (--strategy diloco)";
}

impl Job {
    fn unknown(name: &str) -> Error {
        Error::Config(format!(
            "unknown strategy {name:?}; known: {}",
            Self::NAMES.join(", ")
        ))
    }

    fn does_not_clip(name: &str) -> Error {
        let clipping: Vec<&str> = Self::NAMES
            .iter()
            .copied()
            .filter(|n| Self::clips(n))
            .collect();
        Error::Config(format!(
            "--clip-grad-norm: {name} does not clip gradients ({} do, by the global norm of each \
             step's gradient); --clip-grad-norm 0 trains without",
            clipping.join(", ")
        ))
    }

    /// See [`Strategy::spec`].
    pub fn spec(&self) -> &RunSpec {
        each!(self, j => j.spec())
    }

    /// The spec, to change what a launcher decides after planning (the checkpoint interval
    /// `--max-restarts` chooses).
    pub fn spec_mut(&mut self) -> &mut RunSpec {
        each!(self, j => &mut j.spec)
    }

    /// See [`Strategy::validate`].
    pub fn validate(&self, world: u32) -> Result<()> {
        each!(self, j => j.validate(world))
    }

    /// See [`Strategy::neighbours`].
    pub fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        each!(self, j => j.neighbours(rank, world))
    }

    /// See [`Strategy::needs_data`].
    pub fn needs_data(&self, rank: u32) -> bool {
        each!(self, j => j.needs_data(rank))
    }

    /// See [`Strategy::expendable`].
    pub fn expendable(&self, rank: u32) -> bool {
        each!(self, j => j.expendable(rank))
    }

    /// See [`Strategy::progress_rank`].
    pub fn progress_rank(&self) -> u32 {
        each!(self, j => j.progress_rank())
    }

    /// See [`Strategy::role`].
    pub fn role(&self, rank: u32) -> String {
        each!(self, j => j.role(rank))
    }

    /// See [`Strategy::predicted_step`].
    pub fn predicted_step(&self) -> Option<std::time::Duration> {
        each!(self, j => j.predicted_step())
    }

    /// See [`Strategy::run`].
    pub fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        each!(self, j => j.run(rank, cx))
    }
}
