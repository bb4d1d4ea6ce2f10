//! A `ringtmp train` run as resolved once from its options ([`TrainArgs::resolve`]): the
//! sections a run is made of — strategy, cluster, model, data, training, output, faults — each
//! with what can be decided before the data is read decided here: the strategy and its node
//! count, how the run starts in its directory (`--resume auto` found, a fresh start or a
//! resume), what a failure does, the batch and rate a resumed checkpoint fixes. A restart or a
//! shrunk ring is a new request derived from the last ([`RunRequest::resumed`],
//! [`RunRequest::without_rank`]), never an edit of the arguments; [`RunRequest::options`] is
//! the one place the sections are put back into the options' form, which the planner resolves
//! against the data (the model, data and training defaults that depend on it) and the nodes'
//! `train.toml` holds.
//!
//! Invariants: the request a restart derives from is unchanged; the options it gives are the
//! sections exactly (no field is set anywhere else).

use std::path::{Path, PathBuf};

use anyhow::Result;
use ringtmp_strategy::ring::plan::CutInsideChoice;

use crate::args::{
    ClusterArgs, DataArgs, FaultArgs, ModelArgs, OutputArgs, StrategyArgs, TrainArgs, TrainingArgs,
};
use crate::error::UsageError;

/// A resolved `ringtmp train` run.
#[derive(Clone, Debug)]
pub struct RunRequest {
    /// The strategy and the node processes it runs on.
    pub strategy: StrategySection,
    /// Each rank's emulated share of the cluster (renumbered when a rank leaves).
    pub cluster: ClusterArgs,
    /// The model, resolved against the data by the planner.
    pub model: ModelArgs,
    /// The data, as the planner reads it.
    pub data: DataArgs,
    /// Training: the batch and rate a resumed checkpoint fixes; the rest resolved against the
    /// data by the planner.
    pub training: TrainingArgs,
    /// Where the run writes, and how it starts there.
    pub output: OutputSection,
    /// What the run does when a node fails.
    pub faults: FaultSection,
    /// The batch and rate the user gave (a shrunk run splits the checkpoint's batch again unless
    /// the user chose one).
    given_batch: (Option<usize>, Option<f32>),
}

/// The strategy and its nodes.
#[derive(Clone, Debug)]
pub struct StrategySection {
    /// The strategy's name (`ring` unless given).
    pub name: String,
    /// Node processes (`--nodes`, or [`crate::args::DEFAULT_NODES`]; 1 under `local`).
    pub nodes: u32,
    /// The strategies' own options (a restarted ring keeps its first attempt's cuts); its name
    /// and node count are the section's.
    pub args: StrategyArgs,
}

/// Where the run writes.
#[derive(Clone, Debug)]
pub struct OutputSection {
    /// The run directory (`None` until `train` chooses the default one).
    pub out: Option<PathBuf>,
    /// The checkpoint (or run directory) the run resumes from; `None`: from the beginning.
    pub resume: Option<PathBuf>,
    /// Whether a run already in the directory (not the one resumed) is replaced.
    pub overwrite: bool,
    /// Evaluations, checkpoints and the log (the directory, resume and overwrite are the
    /// section's).
    pub args: OutputArgs,
}

/// What a run does when a node fails.
#[derive(Clone, Debug)]
pub struct FaultSection {
    /// Restarts from the newest checkpoint allowed.
    pub max_restarts: u32,
    /// Whether a restart goes on without the failed node.
    pub shrink_on_failure: bool,
    /// Timeouts, encryption and fault injection (restarts and shrinking are the section's).
    pub args: FaultArgs,
}

impl TrainArgs {
    /// Resolves the merged options into a request: `--resume auto` found (or the run started
    /// over), the checkpoint's batch and rate adopted when resuming without them.
    pub fn resolve(&self) -> Result<RunRequest> {
        let TrainArgs {
            config: _,
            mut strategy,
            cluster,
            model,
            data,
            training,
            mut output,
            mut faults,
        } = self.clone();
        // The values a section decides leave the options it keeps, so each has one place.
        let shrink_on_failure = faults.shrink_on_failure.take().unwrap_or(false);
        let max_restarts = faults.max_restarts.take().unwrap_or(0);
        if shrink_on_failure && max_restarts == 0 {
            return Err(UsageError("--shrink-on-failure needs --max-restarts".into()).into());
        }
        let name = self.strategy().to_string();
        (strategy.name, strategy.nodes) = (None, None);
        let request = RunRequest {
            strategy: StrategySection {
                nodes: if name == "local" { 1 } else { self.nodes() },
                name,
                args: strategy,
            },
            cluster,
            model,
            data,
            given_batch: (training.batch_size, training.lr),
            training,
            output: OutputSection {
                out: output.out.take(),
                resume: output.resume.take(),
                overwrite: output.overwrite.take().unwrap_or(false),
                args: output,
            },
            faults: FaultSection {
                max_restarts,
                shrink_on_failure,
                args: faults,
            },
        };
        request.with_auto_resume()?.with_checkpoint_batch()
    }
}

impl RunRequest {
    /// The options of this request: its sections in the options' form. What the planner
    /// resolves against the data, and what the nodes' `train.toml` holds.
    pub fn options(&self) -> TrainArgs {
        let output = &self.output;
        let faults = &self.faults;
        TrainArgs {
            config: None,
            strategy: StrategyArgs {
                name: Some(self.strategy.name.clone()),
                nodes: Some(self.strategy.nodes),
                ..self.strategy.args.clone()
            },
            cluster: self.cluster.clone(),
            model: self.model.clone(),
            data: self.data.clone(),
            training: self.training.clone(),
            output: OutputArgs {
                out: output.out.clone(),
                resume: output.resume.clone(),
                overwrite: output.overwrite.then_some(true),
                ..output.args.clone()
            },
            faults: FaultArgs {
                max_restarts: (faults.max_restarts > 0).then_some(faults.max_restarts),
                shrink_on_failure: faults.shrink_on_failure.then_some(true),
                ..faults.args.clone()
            },
        }
    }

    /// The options the nodes read: the directory is prepared by then, and a node must not
    /// clear it again.
    pub fn node_options(&self) -> TrainArgs {
        let mut options = self.options();
        options.output.overwrite = None;
        options
    }

    /// The run directory (chosen by then).
    pub fn out(&self) -> PathBuf {
        self.output.out.clone().unwrap_or_default()
    }

    /// The checkpoint the run resumes from, if any.
    pub fn resume(&self) -> Option<&Path> {
        self.output.resume.as_deref()
    }

    /// Whether a run already in the directory is replaced.
    pub fn overwrite(&self) -> bool {
        self.output.overwrite
    }

    /// This request writing into `out`.
    pub fn writing_to(self, out: PathBuf) -> Self {
        Self {
            output: OutputSection {
                out: Some(out),
                ..self.output
            },
            ..self
        }
    }

    /// The next attempt of this run: from checkpoint `dir`, or — when none verifies — from the
    /// beginning in the same directory.
    pub fn resumed(&self, dir: Option<PathBuf>) -> Self {
        let output = OutputSection {
            // Nothing to resume from: the run starts over in the same directory.
            overwrite: self.output.overwrite || dir.is_none(),
            resume: dir,
            ..self.output.clone()
        };
        Self {
            output,
            ..self.clone()
        }
    }

    /// The same run on one node fewer, without node `dead`: its per-rank entries dropped and the
    /// ranks above it moved down one, as the nodes are when the run is planned again. Unless the
    /// user chose the batch, the checkpoint's global batch is split over the workers that remain.
    pub fn without_rank(&self, dead: u32) -> Result<Self> {
        let mut cluster = self.cluster.clone();
        cluster.without_rank(dead);
        let (batch_size, lr) = self.given_batch;
        let request = Self {
            strategy: StrategySection {
                nodes: self.strategy.nodes - 1,
                ..self.strategy.clone()
            },
            cluster,
            training: TrainingArgs {
                batch_size,
                lr,
                ..self.training.clone()
            },
            ..self.clone()
        };
        request.with_checkpoint_batch()
    }

    /// The ring's cuts inside layers as `cut_inside` says (a restart keeping the first
    /// attempt's).
    pub fn with_cut_inside(self, cut_inside: Option<CutInsideChoice>) -> Self {
        let mut strategy = self.strategy;
        strategy.args.options.ring.cut_inside = cut_inside;
        Self { strategy, ..self }
    }

    /// With restarts allowed and no `--checkpoint-every`, checkpoints every `every` steps,
    /// keeping `keep` (the user's `--keep-checkpoints` if given).
    pub fn checkpointing(self, every: u64, keep: usize) -> Self {
        let mut output = self.output;
        output.args.checkpoint_every = Some(every);
        output.args.keep_checkpoints = Some(keep);
        Self { output, ..self }
    }

    /// `--resume auto`: the newest checkpoint under `--out` that verifies (passing over damaged
    /// ones, each named), or — when none does — the run starts from the beginning in that
    /// directory. For launchers that restart a node without knowing where the run stood (Slurm's
    /// requeue, a Kubernetes restart policy).
    fn with_auto_resume(self) -> Result<Self> {
        if self.resume() != Some(Path::new("auto")) {
            return Ok(self);
        }
        let out = self.output.out.clone().ok_or_else(|| {
            UsageError("--resume auto needs --out (the run directory to continue)".into())
        })?;
        let (found, skipped) = ringtmp_model::checkpoint::newest_verified(&out.join("checkpoints"));
        for reason in skipped {
            eprintln!("--resume auto: passing over {reason}");
        }
        match &found {
            Some((dir, manifest)) => eprintln!(
                "--resume auto: resuming from {} (step {})",
                dir.display(),
                manifest.step
            ),
            None => eprintln!(
                "--resume auto: no checkpoint in {} verifies; starting from the beginning",
                out.display()
            ),
        }
        Ok(self.resumed(found.map(|(dir, _)| dir)))
    }

    /// With a resume and no `--batch-size`, the checkpoint's global batch (split over this
    /// run's data-parallel workers), so that any strategy resumes from any other's checkpoint as
    /// it is: the batch and the seed fix the data order a resumed run must continue. The rate
    /// goes with it: a default scaled by this strategy's workers would multiply the
    /// checkpoint's rate (a ring's 0.01 for 64 examples became 0.04 on 4 all-reduce workers
    /// sharing those 64).
    fn with_checkpoint_batch(self) -> Result<Self> {
        let (Some(path), None) = (self.resume(), self.training.batch_size) else {
            return Ok(self);
        };
        // A path that holds no readable checkpoint is reported, precisely, by the resume itself.
        let Some(manifest) = ringtmp_model::checkpoint::resolve(path)
            .and_then(|dir| ringtmp_model::checkpoint::read_manifest(&dir))
            .ok()
        else {
            return Ok(self);
        };
        let workers = ringtmp_strategy::Job::workers(
            &self.strategy.name,
            &self.strategy.args.options,
            self.strategy.nodes,
        )
        .map_err(|e| UsageError(e.to_string()))?;
        if manifest.batch_size % workers != 0 {
            return Err(UsageError(format!(
                "the checkpoint was written with a global batch of {}, which does not split \
                 over {workers} workers; pass --batch-size (per worker) to choose another",
                manifest.batch_size
            ))
            .into());
        }
        let batch = manifest.batch_size / workers;
        eprintln!(
            "resuming with the checkpoint's global batch of {}{}",
            manifest.batch_size,
            if workers > 1 {
                format!(" ({batch} per worker)")
            } else {
                String::new()
            }
        );
        let lr = match (self.training.lr, manifest.lr) {
            (None, Some(lr)) => {
                eprintln!(
                    "resuming with the checkpoint's learning rate of {lr} for that batch (--lr \
                     sets another)"
                );
                Some(lr)
            }
            (lr, _) => lr,
        };
        Ok(Self {
            training: TrainingArgs {
                batch_size: Some(batch),
                lr,
                ..self.training.clone()
            },
            ..self
        })
    }
}

impl ClusterArgs {
    /// Drops node `dead`'s entries and moves the ranks above it down one.
    pub fn without_rank(&mut self, dead: u32) {
        let renumber = |entries: &str| -> String {
            entries
                .split(',')
                .filter_map(|part| match part.split_once(':') {
                    Some((rank, rest)) => match rank.trim().parse::<u32>() {
                        Ok(r) if r == dead => None,
                        Ok(r) if r > dead => Some(format!("{}:{rest}", r - 1)),
                        _ => Some(part.to_string()),
                    },
                    None => Some(part.to_string()),
                })
                .collect::<Vec<_>>()
                .join(",")
        };
        if let Some(links) = self.link.as_mut() {
            links.retain(|l| l.rank != dead);
            for l in links.iter_mut().filter(|l| l.rank > dead) {
                l.rank -= 1;
            }
        }
        self.link.take_if(|links| links.is_empty());
        if let Some(entries) = self.node_cpu.as_mut() {
            *entries = entries
                .iter()
                .map(|e| renumber(e))
                .filter(|e| !e.is_empty())
                .collect();
        }
        self.node_cpu.take_if(|entries| entries.is_empty());
        if let Some(lists) = self.node_speed.as_mut() {
            lists.iter_mut().for_each(|l| l.without_rank(dead));
            lists.retain(|l| !l.is_empty());
        }
        self.node_speed.take_if(|lists| lists.is_empty());
        if let Some(limit) = self.node_memory_limit.as_mut() {
            limit.without_rank(dead);
        }
        self.node_memory_limit.take_if(|limit| limit.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringtmp_strategy::per_node::{PerNode, Speed};

    fn request(args: TrainArgs) -> RunRequest {
        TrainArgs {
            strategy: crate::args::StrategyArgs {
                nodes: Some(4),
                ..Default::default()
            },
            ..args
        }
        .resolve()
        .expect("resolves")
    }

    #[test]
    fn a_run_without_a_rank_drops_its_entries_and_renumbers_the_rest() {
        let first = request(TrainArgs {
            cluster: crate::args::ClusterArgs {
                node_speed: Some(vec![
                    "1:0.5,3:0.25".parse().unwrap(),
                    "2:0.75".parse().unwrap(),
                ]),
                link: Some(vec!["2:100:5".parse().unwrap()]),
                node_cpu: Some(vec!["0:0.5,2:0.5,3:1".into()]),
                node_memory_limit: Some("1:256M,3:1G".parse().unwrap()),
                ..Default::default()
            },
            ..Default::default()
        });
        let next = first.without_rank(2).expect("three nodes remain");
        let shown = |v: &Option<Vec<PerNode<Speed>>>| {
            v.as_ref()
                .map(|l| l.iter().map(ToString::to_string).collect::<Vec<_>>())
        };
        let cluster = &next.cluster;
        assert_eq!(
            shown(&cluster.node_speed),
            Some(vec!["1:0.5,2:0.25".to_string()])
        );
        assert_eq!(cluster.link, None, "rank 2's only entry is gone");
        assert_eq!(cluster.node_cpu, Some(vec!["0:0.5,2:1".into()]));
        let limit = cluster.node_memory_limit.as_ref().map(ToString::to_string);
        assert_eq!(limit.as_deref(), Some("1:256M,2:1G"));
        assert_eq!(next.strategy.nodes, 3);
        // The options the nodes read say so; the request it came from is unchanged.
        let options = next.node_options();
        assert_eq!(options.strategy.nodes, Some(3));
        assert_eq!(options.cluster.node_cpu, Some(vec!["0:0.5,2:1".into()]));
        assert_eq!(first.strategy.nodes, 4);
        assert_eq!(first.cluster.node_cpu, Some(vec!["0:0.5,2:0.5,3:1".into()]));
        // A limit for every node stays one.
        let every = request(TrainArgs {
            cluster: crate::args::ClusterArgs {
                node_memory_limit: Some("256M".parse().unwrap()),
                ..Default::default()
            },
            ..Default::default()
        });
        let next = every.without_rank(0).expect("three nodes remain");
        let limit = next
            .cluster
            .node_memory_limit
            .as_ref()
            .map(ToString::to_string);
        assert_eq!(limit.as_deref(), Some("256M"));
    }

    #[test]
    fn a_restart_resumes_from_a_checkpoint_or_starts_over_in_the_same_directory() {
        let first = request(TrainArgs {
            output: crate::args::OutputArgs {
                out: Some("run".into()),
                ..Default::default()
            },
            ..Default::default()
        })
        .checkpointing(5, 2);
        let resumed = first.resumed(Some("run/checkpoints/step-000000005".into()));
        let options = resumed.node_options();
        assert_eq!(
            options.output.resume.as_deref(),
            Some(Path::new("run/checkpoints/step-000000005"))
        );
        assert_eq!(
            (
                options.output.checkpoint_every,
                options.output.keep_checkpoints
            ),
            (Some(5), Some(2))
        );
        assert_eq!(
            options.output.overwrite, None,
            "the nodes never clear the directory"
        );
        let over = first.resumed(None);
        assert!(over.overwrite() && over.resume().is_none());
        assert_eq!(over.options().output.overwrite, Some(true));
        assert_eq!(
            first.resume(),
            None,
            "the first attempt's request is unchanged"
        );
        assert!(!first.overwrite());
    }

    #[test]
    fn shrinking_needs_restarts_and_local_runs_on_one_node() {
        let refused = TrainArgs {
            faults: crate::args::FaultArgs {
                shrink_on_failure: Some(true),
                ..Default::default()
            },
            ..Default::default()
        }
        .resolve()
        .expect_err("refused");
        assert!(refused.to_string().contains("--max-restarts"), "{refused}");
        let local = TrainArgs {
            strategy: crate::args::StrategyArgs {
                name: Some("local".into()),
                ..Default::default()
            },
            ..Default::default()
        }
        .resolve()
        .expect("resolves");
        assert_eq!(local.strategy.nodes, 1);
        let ring = TrainArgs::default().resolve().expect("resolves");
        assert_eq!(
            (ring.strategy.name.as_str(), ring.strategy.nodes),
            ("ring", crate::args::DEFAULT_NODES)
        );
    }
}
