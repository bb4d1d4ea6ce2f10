//! A `ringtmp train` run as resolved once from its options ([`TrainArgs::resolve`]): the
//! options as given, never written after parsing, and typed sections for what the launcher
//! decides — the strategy and its node count, each rank's emulated share of the cluster, the
//! training settings a resumed checkpoint fixes, where the run writes and how it starts, and
//! what it does when a node fails. A restart or a shrunk ring is a new request derived from
//! the last ([`RunRequest::resumed`], [`RunRequest::without_rank`]), never an edit of the
//! arguments; [`RunRequest::options`] is the one place the sections are written back into the
//! options' form, which the planner and the nodes' `train.toml` read.
//!
//! Invariants: `given` is the merged flags and file exactly as parsed; every section holds a
//! decided value (no `Option` meaning "default" crosses from here but where the planner decides
//! the default against the data: the model, data and training sections of `given`).

use std::path::{Path, PathBuf};

use anyhow::Result;
use ringtmp_strategy::per_node::{Bytes, PerNode, Speed};
use ringtmp_strategy::ring::plan::CutInsideChoice;

use crate::args::TrainArgs;
use crate::error::UsageError;
use crate::links::LinkSpec;

/// A resolved `ringtmp train` run.
#[derive(Clone, Debug)]
pub struct RunRequest {
    /// The options as given (flags over the `--config` file).
    given: TrainArgs,
    /// The strategy and the node processes it runs on.
    pub strategy: StrategySection,
    /// Each rank's emulated share of the cluster.
    pub cluster: ClusterSection,
    /// Training settings decided here rather than given.
    pub training: TrainingSection,
    /// Where the run writes, and how it starts there.
    pub output: OutputSection,
    /// What the run does when a node fails.
    pub faults: FaultSection,
}

/// The strategy and its nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategySection {
    /// The strategy's name (`ring` unless given).
    pub name: String,
    /// Node processes (`--nodes`, or [`crate::args::DEFAULT_NODES`]; 1 under `local`).
    pub nodes: u32,
    /// The ring's cuts inside layers, when a restart keeps the first attempt's.
    pub cut_inside: Option<CutInsideChoice>,
}

/// The per-rank settings of an emulated cluster, renumbered when a rank leaves.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterSection {
    /// `--node-speed`.
    pub node_speed: Option<Vec<PerNode<Speed>>>,
    /// `--link`.
    pub link: Option<Vec<LinkSpec>>,
    /// `--node-cpu` (`RANK:CORES` entries).
    pub node_cpu: Option<Vec<String>>,
    /// `--node-memory-limit`.
    pub node_memory_limit: Option<PerNode<Bytes>>,
}

/// Training settings a resumed checkpoint fixes when the user did not give them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainingSection {
    /// Examples per worker per step: the user's, or the checkpoint's global batch split over
    /// this run's workers.
    pub batch_size: Option<usize>,
    /// The rate: the user's, or the checkpoint's for that batch.
    pub lr: Option<f32>,
    /// Checkpoint cadence `(every, keep)` chosen for restarts when the user gave none.
    pub checkpoints: Option<(u64, usize)>,
}

/// Where the run writes.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputSection {
    /// The run directory (`None` until `train` chooses the default one).
    pub out: Option<PathBuf>,
    /// The checkpoint (or run directory) the run resumes from; `None`: from the beginning.
    pub resume: Option<PathBuf>,
    /// Whether a run already in the directory (not the one resumed) is replaced.
    pub overwrite: bool,
}

/// What a run does when a node fails.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultSection {
    /// Restarts from the newest checkpoint allowed.
    pub max_restarts: u32,
    /// Whether a restart goes on without the failed node.
    pub shrink_on_failure: bool,
}

impl TrainArgs {
    /// Resolves the merged options into a request: `--resume auto` found (or the run started
    /// over), the checkpoint's batch and rate adopted when resuming without them.
    pub fn resolve(&self) -> Result<RunRequest> {
        let given = self.clone();
        let shrink_on_failure = given.shrink_on_failure.unwrap_or(false);
        let max_restarts = given.max_restarts.unwrap_or(0);
        if shrink_on_failure && max_restarts == 0 {
            return Err(UsageError("--shrink-on-failure needs --max-restarts".into()).into());
        }
        let request = RunRequest {
            strategy: StrategySection {
                name: given.strategy().to_string(),
                nodes: if given.strategy() == "local" {
                    1
                } else {
                    given.nodes()
                },
                cut_inside: given.options.ring.cut_inside.clone(),
            },
            cluster: ClusterSection {
                node_speed: given.node_speed.clone(),
                link: given.link.clone(),
                node_cpu: given.node_cpu.clone(),
                node_memory_limit: given.node_memory_limit.clone(),
            },
            training: TrainingSection {
                batch_size: given.batch_size,
                lr: given.lr,
                checkpoints: None,
            },
            output: OutputSection {
                out: given.out.clone(),
                resume: given.resume.clone(),
                overwrite: given.overwrite.unwrap_or(false),
            },
            faults: FaultSection {
                max_restarts,
                shrink_on_failure,
            },
            given,
        };
        request.with_auto_resume()?.with_checkpoint_batch()
    }
}

impl RunRequest {
    /// The options as given.
    pub fn given(&self) -> &TrainArgs {
        &self.given
    }

    /// The options of this request: the given ones with every section written over them. What
    /// the planner resolves against the data, and what the nodes' `train.toml` holds.
    pub fn options(&self) -> TrainArgs {
        let mut options = self.given.clone();
        options.config = None;
        options.strategy = Some(self.strategy.name.clone());
        options.nodes = Some(self.strategy.nodes);
        options.options.ring.cut_inside = self.strategy.cut_inside.clone();
        let ClusterSection {
            node_speed,
            link,
            node_cpu,
            node_memory_limit,
        } = self.cluster.clone();
        (
            options.node_speed,
            options.link,
            options.node_cpu,
            options.node_memory_limit,
        ) = (node_speed, link, node_cpu, node_memory_limit);
        options.batch_size = self.training.batch_size;
        options.lr = self.training.lr;
        if let Some((every, keep)) = self.training.checkpoints {
            options.checkpoint_every = Some(every);
            options.keep_checkpoints = Some(keep);
        }
        options.out.clone_from(&self.output.out);
        options.resume.clone_from(&self.output.resume);
        options.overwrite = self.output.overwrite.then_some(true);
        options
    }

    /// The options the nodes read: the directory is prepared by then, and a node must not
    /// clear it again.
    pub fn node_options(&self) -> TrainArgs {
        let mut options = self.options();
        options.overwrite = None;
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
            out: self.output.out.clone(),
            // Nothing to resume from: the run starts over in the same directory.
            overwrite: self.output.overwrite || dir.is_none(),
            resume: dir,
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
        let request = Self {
            strategy: StrategySection {
                nodes: self.strategy.nodes - 1,
                ..self.strategy.clone()
            },
            cluster,
            training: TrainingSection {
                batch_size: self.given.batch_size,
                lr: self.given.lr,
                ..self.training.clone()
            },
            ..self.clone()
        };
        request.with_checkpoint_batch()
    }

    /// The ring's cuts inside layers as `cut_inside` says (a restart keeping the first
    /// attempt's).
    pub fn with_cut_inside(self, cut_inside: Option<CutInsideChoice>) -> Self {
        Self {
            strategy: StrategySection {
                cut_inside,
                ..self.strategy
            },
            ..self
        }
    }

    /// With restarts allowed and no `--checkpoint-every`, checkpoints every `every` steps,
    /// keeping `keep` (the user's `--keep-checkpoints` if given).
    pub fn checkpointing(self, every: u64, keep: usize) -> Self {
        Self {
            training: TrainingSection {
                checkpoints: Some((every, keep)),
                ..self.training
            },
            ..self
        }
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
            &self.given.options,
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
            training: TrainingSection {
                batch_size: Some(batch),
                lr,
                ..self.training.clone()
            },
            ..self
        })
    }
}

impl ClusterSection {
    /// Drops node `dead`'s entries and moves the ranks above it down one.
    fn without_rank(&mut self, dead: u32) {
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

    fn request(args: TrainArgs) -> RunRequest {
        TrainArgs {
            nodes: Some(4),
            ..args
        }
        .resolve()
        .expect("resolves")
    }

    #[test]
    fn a_run_without_a_rank_drops_its_entries_and_renumbers_the_rest() {
        let first = request(TrainArgs {
            node_speed: Some(vec![
                "1:0.5,3:0.25".parse().unwrap(),
                "2:0.75".parse().unwrap(),
            ]),
            link: Some(vec!["2:100:5".parse().unwrap()]),
            node_cpu: Some(vec!["0:0.5,2:0.5,3:1".into()]),
            node_memory_limit: Some("1:256M,3:1G".parse().unwrap()),
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
        assert_eq!(options.nodes, Some(3));
        assert_eq!(options.node_cpu, Some(vec!["0:0.5,2:1".into()]));
        assert_eq!(first.strategy.nodes, 4);
        assert_eq!(first.given().node_cpu, Some(vec!["0:0.5,2:0.5,3:1".into()]));
        // A limit for every node stays one.
        let every = request(TrainArgs {
            node_memory_limit: Some("256M".parse().unwrap()),
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
            out: Some("run".into()),
            ..Default::default()
        })
        .checkpointing(5, 2);
        let resumed = first.resumed(Some("run/checkpoints/step-000000005".into()));
        let options = resumed.node_options();
        assert_eq!(
            options.resume.as_deref(),
            Some(Path::new("run/checkpoints/step-000000005"))
        );
        assert_eq!(
            (options.checkpoint_every, options.keep_checkpoints),
            (Some(5), Some(2))
        );
        assert_eq!(
            options.overwrite, None,
            "the nodes never clear the directory"
        );
        let over = first.resumed(None);
        assert!(over.overwrite() && over.resume().is_none());
        assert_eq!(over.options().overwrite, Some(true));
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
            shrink_on_failure: Some(true),
            ..Default::default()
        }
        .resolve()
        .expect_err("refused");
        assert!(refused.to_string().contains("--max-restarts"), "{refused}");
        let local = TrainArgs {
            strategy: Some("local".into()),
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
