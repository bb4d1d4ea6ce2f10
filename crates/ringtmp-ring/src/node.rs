//! RingTMP as a [`Strategy`]: the master (rank 0) holds the data and writes the summary, every
//! other rank runs its stage; a job from a file or the network is checked before any node uses it.

use std::collections::BTreeSet;

use ringtmp_data::Dataset;
use ringtmp_metrics::Summary;

use crate::net::{Plain, RingCx};
use crate::plan::RingOptions;
use crate::run::driver::{MasterSetup, RingJob, run_master, run_worker};
use ringtmp_contract::TrainConfig;
use ringtmp_contract::contract::{
    Cluster, NodeCx, PlanReport, Strategy, ring_neighbours, validate_shared,
};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::spec::RunSpec;

impl Strategy for RingJob {
    const NAME: &'static str = "ring";
    const FAMILY: ringtmp_contract::contract::Family = ringtmp_contract::contract::Family::Pipeline;
    const SHORT_FORM: Option<(&'static str, &'static str)> = Some(("--schedule", "SCHEDULE"));
    const CLIPS: bool = true;
    type Options = RingOptions;

    fn plan(
        config: TrainConfig,
        options: &RingOptions,
        cluster: &Cluster,
        data: &Dataset,
        report: &mut PlanReport,
    ) -> Result<Self> {
        crate::plan::plan(config, options, cluster, data, report)
    }

    /// Rings of rings split each global batch over their rings.
    fn workers(options: &RingOptions, nodes: u32) -> Result<usize> {
        Ok(options.rings(nodes)?.max(1))
    }

    /// The partition is planned from every node's own timing of the layers.
    fn profile_request(
        config: TrainConfig,
        options: &RingOptions,
        cluster: &Cluster,
        data: &Dataset,
        budget_seconds: f64,
    ) -> Result<Option<ringtmp_contract::machine::ProfileRequest>> {
        crate::plan::profile_request(config, options, cluster, data, budget_seconds).map(Some)
    }

    fn predicted_step(&self) -> Option<std::time::Duration> {
        // Every stage's compute and card in turn, for each micro-batch: a step's length with no
        // overlap at all, so a bound above it.
        let one: f64 = self
            .partition
            .iter()
            .map(|s| s.predicted_seconds + s.predicted_link_seconds)
            .sum();
        let step = one * self.micro_batches as f64;
        (step.is_finite() && step > 0.0).then(|| std::time::Duration::from_secs_f64(step))
    }

    fn spec(&self) -> &RunSpec {
        &self.spec
    }

    fn role(&self, rank: u32) -> String {
        let Some(stage) = self.partition.iter().find(|s| s.rank == rank) else {
            return "idle: the plan leaves this node out; it leaves once the ring has formed"
                .into();
        };
        let master = if rank == 0 {
            "; the master: it holds the data and the labels and computes the loss"
        } else {
            ""
        };
        let head = match (&self.head, rank) {
            (Some(head), 0) => format!(" and the head, layers {}..{}", head.start, head.end),
            _ => String::new(),
        };
        format!(
            "a ring stage: layers {}..{}{head} and their optimizer state{master}",
            stage.start, stage.end
        )
    }

    fn validate(&self, world: u32) -> Result<()> {
        validate_shared(
            &self.spec,
            world,
            self.partition.len() * self.replicas.max(1) + self.idle_nodes as usize,
        )?;
        if self.idle_nodes > 0 && (self.replicas > 1 || self.replica_every > 0) {
            return Err(Error::Config(
                "invalid job: idle nodes with rings of rings or stage replicas".into(),
            ));
        }
        let bad = |what: String| Err(Error::Config(format!("invalid job: {what}")));
        if self.replicas > 1
            && self.replica_every > 0
            && (self.replica_every != self.average_every || self.gossip_every > 0)
        {
            return bad(format!(
                "rings of rings with stage replicas every {} mini-batches must synchronise \
                 every as many (not every {}, gossip {})",
                self.replica_every, self.average_every, self.gossip_every
            ));
        }
        if self.micro_batches == 0 || self.micro_batches > self.spec.batch_size {
            return bad(format!(
                "{} micro-batches for mini-batches of {}",
                self.micro_batches, self.spec.batch_size
            ));
        }
        // The stages (and the head on the master) must cover the model's layers once, in order.
        let layers = self.layers()?.len();
        let mut at = 0;
        for (rank, stage) in self.partition.iter().enumerate() {
            if stage.rank as usize != rank || stage.start != at || stage.end <= stage.start {
                return bad(format!(
                    "stage {rank} holds layers {}..{} but the next layer is {at}",
                    stage.start, stage.end
                ));
            }
            at = stage.end;
        }
        if let Some(head) = &self.head {
            if head.start != at || head.end <= head.start {
                return bad(format!(
                    "the head holds layers {}..{} but the next layer is {at}",
                    head.start, head.end
                ));
            }
            at = head.end;
        }
        if at != layers {
            return bad(format!(
                "the partition covers layers 0..{at} of a model with {layers}"
            ));
        }
        if self.node_speeds.len() != self.partition.len()
            || self
                .node_speeds
                .iter()
                .any(|s| !(s.is_finite() && *s > 0.0 && *s <= 1.0))
        {
            return bad(format!(
                "node speeds {:?} for {} nodes (each in (0, 1])",
                self.node_speeds,
                self.partition.len()
            ));
        }
        Ok(())
    }

    fn neighbours(&self, rank: u32, world: u32) -> BTreeSet<u32> {
        if self.replica_every > 0 {
            // Healing closes the ring around any node and the master re-forms it; in rings of
            // rings, a healed ring's nodes also meet new copies of their stages, and its master
            // tells every other ring's nodes: every node is linked to every other from the
            // start.
            return (0..world).filter(|r| *r != rank).collect();
        }
        if self.replicas > 1 {
            // Its ring, and the ring of its stage's copies.
            let stages = self.partition.len() as u32;
            let (ring, stage) = (rank / stages, rank % stages);
            let rings = world / stages;
            let mut links: BTreeSet<u32> = [
                ring * stages + (stage + 1) % stages,
                ring * stages + (stage + stages - 1) % stages,
                ((ring + 1) % rings) * stages + stage,
                ((ring + rings - 1) % rings) * stages + stage,
            ]
            .into_iter()
            .collect();
            if self.gossips_params() {
                // The stage's copies' gossip graph.
                links.extend(
                    ringtmp_collective::mixing::bipartite_neighbours(ring, rings)
                        .into_iter()
                        .map(|r| r * stages + stage),
                );
            }
            // Every ring's master reports its summary to rank 0 (with three rings or more,
            // not all of them are rank 0's neighbours in the stage group).
            match (rank, stage) {
                (0, _) => links.extend((1..rings).map(|r| r * stages)),
                (_, 0) => {
                    links.insert(0);
                }
                _ => {}
            }
            links.remove(&rank);
            return links;
        }
        let ring = self.partition.len() as u32;
        if rank >= ring {
            // Left out by the plan.
            return BTreeSet::new();
        }
        ring_neighbours(rank, world.min(ring))
    }

    fn expendable(&self, rank: u32) -> bool {
        // Any node but a ring's master (it holds its ring's data).
        self.replica_every > 0 && !(rank as usize).is_multiple_of(self.partition.len().max(1))
    }

    fn needs_data(&self, rank: u32) -> bool {
        // Every ring's master (rings of rings); not a node the plan leaves out.
        (rank as usize).is_multiple_of(self.partition.len().max(1))
            && (rank as usize) < self.partition.len() * self.replicas.max(1)
    }

    fn run(&self, rank: u32, cx: &mut NodeCx<'_>) -> Result<Option<Summary>> {
        if self.replicas > 1 {
            return crate::rings::run(self, rank, cx);
        }
        if self.replica_every > 0 {
            let mut plain = Plain(&mut *cx.net);
            let mut ring_cx = RingCx {
                net: &mut plain,
                data: cx.data,
                on_event: &mut *cx.on_event,
            };
            return crate::heal::run(self, rank, &mut ring_cx);
        }
        if rank as usize >= self.partition.len() {
            tracing::debug!(
                "rank {rank}: the plan uses {} nodes; this one leaves",
                self.partition.len()
            );
            return Ok(None);
        }
        if rank != 0 {
            run_worker(self, &mut Plain(cx.net))?;
            return Ok(None);
        }
        let setup = MasterSetup { data: cx.data()? };
        let outcome = run_master(self, &setup, &mut Plain(cx.net), cx.on_event)?;
        Ok(Some(outcome.summary))
    }
}
