//! The claims RingTMP was proposed on, decided from the runs: what each measured, what first
//! principles predict, and the verdict — which can come out either way.

use ringtmp_strategy::Family;

use super::quality::Quality;

use super::runs::*;

/// One of the claims RingTMP was proposed on, with what the runs measured, what first principles
/// predict, and the verdict — which can come out either way.
pub(super) struct Claim {
    /// The claim.
    pub(super) title: String,
    /// The measured figures.
    pub(super) measured: String,
    /// The prediction beside them.
    pub(super) predicted: String,
    /// "holds", "does not hold" or why it was not decided.
    pub(super) verdict: String,
}

/// Bytes a run sent for training (evaluation traffic left out), per sample.
pub(super) fn training_bytes_per_sample(f: &Finished) -> f64 {
    let sent: u64 = f
        .summary
        .per_node
        .iter()
        .map(|n| n.bytes_sent.saturating_sub(n.eval_bytes_sent))
        .sum();
    sent as f64 / f.summary.samples.max(1) as f64
}

/// First principles: bytes per sample a ring job moves (every node's block output forward and
/// its gradient back, f32 or the wire type) and a parameter server moves (each worker pushes
/// its gradients and pulls the parameters once per iteration of its batch).
pub(super) fn predicted_bytes_per_sample(job: &ringtmp_strategy::Job) -> Option<f64> {
    let spec = job.spec();
    let layers = spec.layers().ok()?;
    let width = spec.wire_dtype.size() as f64;
    let params: usize = layers.iter().map(|l| l.param_count()).sum();
    match job {
        ringtmp_strategy::Job::Ring(ring) => ring
            .partition
            .iter()
            .map(|p| {
                let last = layers.get(p.end.checked_sub(1)?)?;
                Some(2.0 * width * last.output.numel() as f64)
            })
            .sum::<Option<f64>>(),
        ringtmp_strategy::Job::Ps(ps) => {
            Some(2.0 * width * params as f64 / ps.spec.batch_size.max(1) as f64)
        }
        _ => None,
    }
}

pub(super) fn claims(finished: &[Finished], rows: &[Row], quality: &Quality) -> Vec<Claim> {
    let runs = Runs::new(finished, rows, *quality);
    vec![
        runs.traffic(),
        runs.scaling(),
        runs.memory(),
        runs.accuracy(),
        runs.diloco_rings(),
    ]
}

/// Whether `strategy` is rings of rings synchronised like DiLoCo (`--replica-sync diloco:H`).
pub(super) fn is_diloco_rings(strategy: &str) -> bool {
    is_ring(strategy) && strategy.contains("replica-sync=diloco")
}

/// The family of a run's strategy, as `compare` names the run (`ring`, `ps:ssp:2`,
/// `ring+nodes=8`: the strategy's name, then its variant or options), asked of the strategy.
fn family_of(strategy: &str) -> Option<Family> {
    let name = strategy.split([':', '+']).next().unwrap_or(strategy);
    ringtmp_strategy::Job::family(name)
}

/// Whether `strategy` is data-parallel: every worker a whole replica.
pub(super) fn is_data_parallel(strategy: &str) -> bool {
    family_of(strategy).is_some_and(Family::is_data_parallel)
}

pub(super) fn is_ring(strategy: &str) -> bool {
    family_of(strategy) == Some(Family::Pipeline)
}

pub(super) fn is_ps(strategy: &str) -> bool {
    family_of(strategy) == Some(Family::ParameterServer)
}

/// A claim the runs cannot decide, and why.
pub(super) fn undecided(title: &str, why: &str) -> Claim {
    Claim {
        title: title.into(),
        measured: "—".into(),
        predicted: "—".into(),
        verdict: format!("not decided: {why}"),
    }
}

/// The runs a report's claims are decided on.
pub(super) struct Runs<'a> {
    pub(super) finished: &'a [Finished],
    pub(super) rows: &'a [Row],
    /// The node counts compared.
    pub(super) counts: std::collections::BTreeSet<u32>,
    /// The largest of them, where each claim is decided.
    pub(super) largest: u32,
    /// What (d) compares.
    pub(super) quality: Quality,
}

impl<'a> Runs<'a> {
    pub(super) fn new(finished: &'a [Finished], rows: &'a [Row], quality: Quality) -> Self {
        let counts: std::collections::BTreeSet<u32> =
            finished.iter().map(|f| f.plan.nodes).collect();
        let largest = counts.iter().copied().max().unwrap_or(0);
        Self {
            finished,
            rows,
            counts,
            largest,
            quality,
        }
    }

    /// The first repetition of a run of `strategy` on `nodes` nodes.
    pub(super) fn first(
        &self,
        strategy: &dyn Fn(&str) -> bool,
        nodes: u32,
    ) -> Option<&'a Finished> {
        self.finished
            .iter()
            .find(|f| f.plan.repeat == 0 && f.plan.nodes == nodes && strategy(&f.plan.strategy))
    }

    /// (e) Rings synchronised like DiLoCo: past one ring, with less traffic than any
    /// data-parallel strategy.
    pub(super) fn diloco_rings(&self) -> Claim {
        let largest = self.largest;
        let title = "(e) RingTMP rings synchronised like DiLoCo scale past one ring with less \
                     traffic than any data-parallel strategy";
        let Some(rings) = self.first(&is_diloco_rings, largest) else {
            return undecided(
                title,
                "compare needs rings of rings under DiLoCo in --strategies \
                 (ring+ring-nodes=S+replica-sync=diloco:H)",
            );
        };
        let (unit, per) = (self.quality.unit(), self.quality.per_sample());
        let bytes = |f: &Finished| training_bytes_per_sample(f) / per;
        let mut others: Vec<(String, f64)> = self
            .finished
            .iter()
            .filter(|f| f.plan.repeat == 0 && f.plan.nodes == largest)
            .filter(|f| is_data_parallel(&f.plan.strategy))
            .map(|f| (f.plan.strategy.clone(), bytes(f)))
            .collect();
        if others.is_empty() {
            return undecided(
                title,
                "compare needs a data-parallel strategy beside the rings",
            );
        }
        others.sort_by(|a, b| a.1.total_cmp(&b.1));
        let mine = bytes(rings);
        let speed = |strategy: &dyn Fn(&str) -> bool| {
            self.rows
                .iter()
                .find(|r| r.nodes == largest && strategy(&r.strategy))
                .and_then(|r| r.samples_per_second.map(|v| v.0))
        };
        let one_ring = |s: &str| {
            s == "ring" || (is_ring(s) && !s.contains("ring-nodes") && !s.contains("replicas"))
        };
        let (rings_speed, ring_speed) = (speed(&is_diloco_rings), speed(&one_ring));
        let (least, least_bytes) = others[0].clone();
        let measured = format!(
            "{mine:.0} bytes per {unit} for {} against {} on {largest} nodes; {}",
            rings.plan.strategy,
            others
                .iter()
                .map(|(s, b)| format!("{b:.0} for {s}"))
                .collect::<Vec<_>>()
                .join(", "),
            match (rings_speed, ring_speed) {
                (Some(r), Some(o)) => format!("{r:.0} {unit}s/s against one ring's {o:.0}"),
                _ => "no single ring on as many nodes to compare speed with".into(),
            }
        );
        let faster = match (rings_speed, ring_speed) {
            (Some(r), Some(o)) => r >= o,
            _ => true,
        };
        Claim {
            title: title.into(),
            measured,
            predicted: "the rings' traffic is their boundaries' activations for every sample \
                        plus each stage's pseudo-gradient every H mini-batches; a data-parallel \
                        worker moves its whole model every step (DiLoCo: every H steps)"
                .into(),
            verdict: match (mine < least_bytes, faster) {
                (true, true) => format!(
                    "holds: {:.1}× fewer bytes than the least of them ({least})",
                    least_bytes / mine.max(1e-9)
                ),
                (false, _) => format!(
                    "does not hold: {least} moved {:.1}× fewer bytes",
                    mine / least_bytes.max(1e-9)
                ),
                (true, false) => "does not hold: fewer bytes, but slower than one ring".into(),
            },
        }
    }

    /// (a) Less communication than a parameter server.
    pub(super) fn traffic(&self) -> Claim {
        let (first, largest) = (|s: &dyn Fn(&str) -> bool, n| self.first(s, n), self.largest);
        let title = "(a) RingTMP communicates less than a parameter server";
        match (first(&is_ring, largest), first(&is_ps, largest)) {
            (Some(ring), Some(ps)) => {
                // Per sample, or per token of a language model.
                let (unit, per) = (self.quality.unit(), self.quality.per_sample());
                let (r, p) = (
                    training_bytes_per_sample(ring) / per,
                    training_bytes_per_sample(ps) / per,
                );
                let pred = |f: &Finished| {
                    f.job
                        .as_ref()
                        .and_then(predicted_bytes_per_sample)
                        .map_or("—".into(), |v| format!("{:.0}", v / per))
                };
                Claim {
                    title: title.into(),
                    measured: format!(
                        "{r:.0} bytes per {unit} for the ring against {p:.0} for {} on \
                         {largest} nodes (training traffic, framing included)",
                        ps.plan.strategy
                    ),
                    predicted: format!(
                        "{} for the ring (2 × Σ activation bytes at its {} boundaries) against {} for \
                     the parameter server (2 × |W| × bytes per value ÷ worker batch)",
                        pred(ring),
                        ring.summary.per_node.len(),
                        pred(ps)
                    ),
                    verdict: if r < p {
                        format!("holds: the ring moved {:.1}× fewer bytes", p / r.max(1e-9))
                    } else {
                        format!(
                            "does not hold: the ring moved {:.1}× more bytes (large activations at \
                         its boundaries)",
                            r / p.max(1e-9)
                        )
                    },
                }
            }
            _ => undecided(title, "compare needs ring and ps in --strategies"),
        }
    }

    /// (b) At least equal scalability.
    pub(super) fn scaling(&self) -> Claim {
        let (counts, largest, rows) = (&self.counts, self.largest, self.rows);
        let title = "(b) RingTMP scales at least as well as a parameter server";
        let smallest = counts.iter().copied().min().unwrap_or(0);
        let speed = |strategy: &dyn Fn(&str) -> bool, nodes: u32| {
            rows.iter()
                .find(|r| r.nodes == nodes && strategy(&r.strategy))
                .and_then(|r| r.samples_per_second.map(|v| v.0))
        };
        match (
            counts.len() > 1,
            speed(&is_ring, smallest),
            speed(&is_ring, largest),
            speed(&is_ps, smallest),
            speed(&is_ps, largest),
        ) {
            (true, Some(r0), Some(r1), Some(p0), Some(p1)) => {
                let (rs, ps) = (r1 / r0.max(1e-9), p1 / p0.max(1e-9));
                Claim {
                    title: title.into(),
                    measured: format!(
                        "from {smallest} to {largest} nodes the ring's samples/s went ×{rs:.2} \
                     ({r0:.0} → {r1:.0}), the parameter server's ×{ps:.2} ({p0:.0} → {p1:.0})"
                    ),
                    predicted: "the ring's per-sample traffic does not grow with the nodes (each \
                            boundary is crossed once per sample), the server's link carries \
                            every worker's push and pull"
                        .into(),
                    verdict: if rs >= ps * 0.95 {
                        "holds".into()
                    } else {
                        "does not hold".into()
                    },
                }
            }
            _ => undecided(
                title,
                "needs ring and ps at two node counts or more (--nodes 2,4)",
            ),
        }
    }

    /// (c) Larger models trainable.
    pub(super) fn memory(&self) -> Claim {
        let (first, largest, finished) = (
            |s: &dyn Fn(&str) -> bool, n| self.first(s, n),
            self.largest,
            self.finished,
        );
        let title = "(c) RingTMP trains models larger than a node's memory allows data-parallel";
        let state = |f: &Finished| {
            f.summary
                .per_node
                .iter()
                .map(|n| n.param_bytes + n.optimizer_bytes)
                .max()
                .unwrap_or(0)
        };
        let rss = |f: &Finished| {
            f.summary
                .per_node
                .iter()
                .map(|n| n.peak_rss_bytes)
                .max()
                .unwrap_or(0)
        };
        let replicas: Vec<&Finished> = finished
            .iter()
            .filter(|f| f.plan.repeat == 0 && f.plan.nodes == largest && !is_ring(&f.plan.strategy))
            .filter(|f| !is_ps(&f.plan.strategy) && f.plan.strategy != "local")
            .collect();
        match (first(&is_ring, largest), replicas.first()) {
            (Some(ring), Some(_)) => {
                let smallest_replica = replicas.iter().map(|f| rss(f)).min().unwrap_or(0);
                let replica_state = replicas.iter().map(|f| state(f)).max().unwrap_or(0);
                let (ring_rss, ring_state) = (rss(ring), state(ring));
                Claim {
                    title: title.into(),
                    measured: format!(
                        "largest node's peak memory: ring {:.0} MB against {:.0} MB for the \
                     smallest data-parallel one",
                        ring_rss as f64 / 1e6,
                        smallest_replica as f64 / 1e6
                    ),
                    predicted: format!(
                        "parameters and optimizer state on the ring's largest node {:.1} MB against \
                     a whole replica's {:.1} MB: under one per-node limit the ring fits a model \
                     about {:.1}× larger",
                        ring_state as f64 / 1e6,
                        replica_state as f64 / 1e6,
                        replica_state as f64 / ring_state.max(1) as f64
                    ),
                    verdict: if ring_rss < smallest_replica {
                        "holds".into()
                    } else {
                        "does not hold on this model: the process's own memory (binary, runtime, \
                     buffers) outweighs the model state"
                            .into()
                    },
                }
            }
            _ => undecided(
                title,
                "needs ring and a data-parallel strategy (allreduce, dpsgd, adpsgd)",
            ),
        }
    }

    /// (d) Equal accuracy (a language model's: validation loss) in equal time.
    pub(super) fn accuracy(&self) -> Claim {
        let (largest, rows, quality) = (self.largest, self.rows, &self.quality);
        let title = format!(
            "(d) RingTMP reaches the same {} in the same time",
            quality.name()
        );
        let title = title.as_str();
        // The ring's best configuration (the best final value, then the earliest to the
        // target) against the best of the others.
        let rank = |r: &&Row| {
            (
                quality.rank(r.final_quality.map(|a| a.0)),
                r.time_to_target.map_or(f64::INFINITY, |t| t.0),
            )
        };
        let ring_row = rows
            .iter()
            .filter(|r| r.nodes == largest && is_ring(&r.strategy))
            .min_by(|a, b| {
                rank(a)
                    .partial_cmp(&rank(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        let others: Vec<&Row> = rows
            .iter()
            .filter(|r| r.nodes == largest && !is_ring(&r.strategy))
            .collect();
        match ring_row {
            Some(ring) if !others.is_empty() => {
                let best_other = others
                    .iter()
                    .filter_map(|r| r.time_to_target.map(|t| (t.0, r)))
                    .min_by(|a, b| a.0.total_cmp(&b.0));
                let best_value = quality
                    .best_of(others.iter().filter_map(|r| r.final_quality.map(|a| a.0)))
                    .unwrap_or(f64::NAN);
                let ring_value = ring.final_quality.map_or(f64::NAN, |a| a.0);
                let ring_time = ring.time_to_target.map(|t| t.0);
                let measured = format!(
                    "{}: final {}, target ({}) after {}; best other: final {}, target after {}",
                    ring.strategy,
                    quality.show(ring_value),
                    quality.target_text(),
                    ring_time.map_or("never".into(), |t| format!("{t:.1} s")),
                    quality.show(best_value),
                    best_other.map_or("never".into(), |(t, r)| format!(
                        "{t:.1} s ({})",
                        r.strategy
                    ))
                );
                // A run that stopped training before the other side reached the target was not
                // given the time: it decides nothing (a sample budget cuts the faster strategies
                // short; --train-seconds gives every run the same time).
                let trained = |r: &Row| r.train_seconds.map_or(0.0, |t| t.0);
                let cut_short = |rows: &[&Row], reached_at: f64| -> Vec<String> {
                    rows.iter()
                        .filter(|r| r.time_to_target.is_none() && trained(r) < 0.9 * reached_at)
                        .map(|r| format!("{} ({:.1} s)", r.strategy, trained(r)))
                        .collect()
                };
                let verdict = match (ring_time, best_other) {
                    (Some(t), Some((o, _)))
                        if t <= o * 1.1 && quality.as_good_as(ring_value, best_value) =>
                    {
                        "holds".to_string()
                    }
                    (Some(t), None) => match cut_short(&others, t) {
                        short if short.is_empty() => {
                            "holds: only the ring reached the target".to_string()
                        }
                        short => format!(
                            "not decided: {} stopped training before the ring reached the target \
                         ({t:.1} s); compare at equal time (--train-seconds)",
                            short.join(", ")
                        ),
                    },
                    (None, Some((o, _))) if trained(ring) < 0.9 * o => format!(
                        "not decided: {} stopped training after {:.1} s, before the others reached \
                     the target ({o:.1} s); compare at equal time (--train-seconds)",
                        ring.strategy,
                        trained(ring)
                    ),
                    (None, None) => "not decided: no strategy reached the target".to_string(),
                    _ => "does not hold".to_string(),
                };
                Claim {
                    title: title.into(),
                    measured,
                    predicted:
                        "the same updates as synchronous SGD (flushed schedules) or bounded \
                            staleness (async); the time depends on (a) and the pipeline bubble \
                            (N − 1)/(M + N − 1) of the flushed schedules"
                            .into(),
                    verdict,
                }
            }
            _ => undecided(title, "needs ring and another strategy"),
        }
    }
}
