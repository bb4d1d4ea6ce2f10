//! The one training loop of the synchronous data-parallel strategies. Every worker holds a whole
//! replica and trains on its share of each global batch; how the workers then agree is the
//! strategy's [`SyncRule`]: the gradients' mean every step (all-reduce), the outer step every H
//! steps per fragment (DiLoCo), the neighbours' models every step (D-PSGD). The loop owns what
//! all of them do the same way — the replica opened (restored when resuming), the batch plan
//! and the share's buffers, the clocks, rank 0's recorder, the step records, the evaluation and
//! checkpoint cadence, and the end: every worker's report to rank 0 and the run's summary.
//!
//! Invariants: a rule changes the model only inside [`SyncRule::step`] (and in a gathering of
//! [`SyncRule::with_model`]), so every evaluation and checkpoint sees the end of a step; rank 0
//! alone holds the recorder; a step the rule abandons ([`Stepped::Redo`], a regroup) is neither
//! counted nor recorded, and the run's samples are the global batches of the steps it trained.
//!
//! AD-PSGD keeps a loop of its own: its workers do not step together (a global step is N
//! iterations counted by rank 0's coordinator), so no per-step hook can hold it; it shares the
//! opening, the share's forward pass and the reports with this loop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ringtmp_data::{BatchPlan, Dataset};
use ringtmp_metrics::DroppedNode;
use ringtmp_model::{Layer, Optimizer, Stage};
use ringtmp_transport::{Clock, Transport};

use crate::replicas::{ShareBuffers, WorkerClock, WorkerOutcome};
use ringtmp_contract::error::{Error, Result};
use ringtmp_contract::recorder::{RunRecorder, Verdict};
use ringtmp_contract::spec::RunSpec;

/// What a worker of a data-parallel run starts from.
pub struct Opening<'a> {
    /// The run.
    pub spec: &'a RunSpec,
    /// The strategy's name, for the records.
    pub strategy: &'static str,
    /// This worker's rank.
    pub rank: u32,
    /// Workers the run starts with.
    pub workers: usize,
    /// Emulated relative speed per rank (1.0 where absent).
    pub node_speeds: &'a [f64],
    /// The data.
    pub data: &'a Dataset,
    /// A model to start from instead of the seed's or the resumed one (tests of the
    /// synchronisation itself start the workers apart).
    pub initial: Option<&'a [f32]>,
}

impl<'a> Opening<'a> {
    /// Worker `rank` of `workers` of a run of `strategy`, from the seed's model or the resumed
    /// one.
    pub fn of(
        spec: &'a RunSpec,
        strategy: &'static str,
        rank: u32,
        workers: usize,
        node_speeds: &'a [f64],
        data: &'a Dataset,
    ) -> Self {
        Self {
            spec,
            strategy,
            rank,
            workers,
            node_speeds,
            data,
            initial: None,
        }
    }
}

/// One worker's replica, its share of the batches and its clocks, as the loop hands them to
/// the rule.
pub struct Worker<'a> {
    /// The run.
    pub spec: &'a RunSpec,
    /// The data.
    pub data: &'a Dataset,
    /// This worker's rank.
    pub rank: u32,
    /// Workers the run started with.
    pub workers: usize,
    /// The model's layers (a rule that forms another model of them, D-PSGD's consensus).
    pub layers: Vec<Layer>,
    /// The replica.
    pub stage: Stage,
    /// Its optimizer (the inner one, for DiLoCo).
    pub optimizer: Optimizer,
    /// The share's inputs, labels and loss gradient, after [`Worker::forward`].
    pub share: ShareBuffers,
    /// The training clock.
    pub clock: Arc<dyn Clock>,
    plan: BatchPlan,
    speed: f64,
    /// Seconds computing, on the training clock.
    pub compute_seconds: f64,
    /// Seconds waiting for the others (reduction, gossip, synchronisation).
    pub wait_seconds: f64,
    /// Iterations this worker trained (abandoned ones included, skipped ones not).
    pub iterations: u64,
    /// Examples of this worker's own shares, where the run counts the workers' sum (DiLoCo,
    /// whose workers may skip steps; 0 elsewhere).
    pub own_samples: u64,
}

/// A span of computing, started by [`Worker::start_compute`].
#[must_use = "a span counts only when ended by Worker::computed"]
pub struct ComputeSpan {
    at: Duration,
    wall: Instant,
}

impl<'a> Worker<'a> {
    fn open(opening: &Opening<'a>, net: &dyn Transport) -> Result<Self> {
        let spec = opening.spec;
        let (layers, mut stage, optimizer) = spec.open_replica()?;
        if let Some(initial) = opening.initial {
            stage.params_mut().copy_from_slice(initial);
        }
        let global = spec.batch_size * opening.workers;
        Ok(Self {
            spec,
            data: opening.data,
            rank: opening.rank,
            workers: opening.workers,
            layers,
            stage,
            optimizer,
            share: ShareBuffers::default(),
            clock: net.clock(),
            plan: BatchPlan::new(opening.data.train.len(), global, spec.seed)?,
            speed: opening
                .node_speeds
                .get(opening.rank as usize)
                .copied()
                .unwrap_or(1.0),
            compute_seconds: 0.0,
            wait_seconds: 0.0,
            iterations: 0,
            own_samples: 0,
        })
    }

    /// The forward pass and loss of share `position` of `of` of step `step`'s global batch
    /// (see [`crate::replicas::forward_share`]); the loss's gradient is left in `self.share.dlogits`.
    pub fn forward(&mut self, position: u32, of: usize, step: u64) -> Result<f64> {
        crate::replicas::forward_share(
            self.spec,
            &mut self.plan,
            self.data,
            &mut self.stage,
            position,
            of,
            step,
            &mut self.share,
        )
    }

    /// Starts a span of computing.
    pub fn start_compute(&self) -> ComputeSpan {
        ComputeSpan {
            at: self.clock.now(),
            wall: Instant::now(),
        }
    }

    /// Ends `span`: the clock accounts it at this worker's emulated speed, and its seconds
    /// count as computing. Returns them.
    pub fn computed(&mut self, span: ComputeSpan) -> f64 {
        self.clock.computed(span.wall.elapsed(), self.speed);
        let seconds = (self.clock.now() - span.at).as_secs_f64();
        self.compute_seconds += seconds;
        seconds
    }

    /// Adds the time since `since` to the seconds spent waiting for the others.
    pub fn waited_since(&mut self, since: Duration) {
        self.wait_seconds += (self.clock.now() - since).as_secs_f64();
    }
}

/// Where a rule reports what it does: rank 0's recorder (`None` elsewhere) and the run's events.
pub struct Log<'l> {
    /// Rank 0's recorder.
    pub recorder: Option<&'l mut RunRecorder>,
    /// The run's events.
    pub on_event: &'l mut dyn FnMut(&ringtmp_contract::Event),
}

/// What a rule did with a step.
pub enum Stepped {
    /// The step is trained: its loss (`None` when this worker skipped it), the rate to record
    /// with it, and the step count to go on from (one more, or rank 0's after a regroup).
    Trained {
        /// The loss to record.
        loss: Option<f64>,
        /// The rate to record.
        lr: f32,
        /// Steps done.
        next: u64,
    },
    /// The step was abandoned (the workers regrouped): go on from `from`, nothing recorded.
    Redo {
        /// Steps done.
        from: u64,
    },
}

/// The model rank 0 evaluates and checkpoints.
pub struct RecordedModel<'m> {
    /// The model.
    pub stage: &'m mut Stage,
    /// The optimizer state checkpointed with it.
    pub optimizer: &'m Optimizer,
    /// Every worker's own model (rank, parameters), checkpointed beside it.
    pub replicas: &'m [(u32, &'m [f32])],
    /// An event written after the evaluation (D-PSGD's consensus distance).
    pub after_eval: Option<serde_json::Value>,
}

/// What a rule adds to the end of the run.
#[derive(Default)]
pub struct Ending {
    /// The workers whose reports rank 0 awaits (the survivors).
    pub members: Vec<u32>,
    /// The workers that left the run.
    pub dropped: Vec<DroppedNode>,
    /// This worker's own model's test accuracy, where the workers' models differ.
    pub own_accuracy: Option<f64>,
    /// Optimizer state the replica's optimizer does not count (DiLoCo's outer state).
    pub extra_optimizer_bytes: u64,
    /// Whether the run's samples are the sum of the workers' own (see [`Worker::own_samples`]).
    pub samples_from_reports: bool,
    /// The last consensus distance, for the summary.
    pub consensus_distance: Option<f64>,
}

/// How the workers of a data-parallel strategy agree: the hook of the one loop.
pub trait SyncRule {
    /// The fields this rule adds to the run's start event.
    fn start_fields(&self, worker: &Worker<'_>) -> serde_json::Value;

    /// Trains step `step` on this worker's share and synchronises as the rule does.
    fn step(
        &mut self,
        worker: &mut Worker<'_>,
        step: u64,
        net: &mut dyn Transport,
        log: &mut Log<'_>,
    ) -> Result<Stepped>;

    /// Calls `record` on rank 0 with the model evaluated and checkpointed after `done` steps
    /// (the replica, by default). Called on every worker, for a rule that gathers that model
    /// from them.
    fn with_model(
        &mut self,
        worker: &mut Worker<'_>,
        done: u64,
        net: &mut dyn Transport,
        record: &mut dyn FnMut(RecordedModel<'_>) -> Result<()>,
    ) -> Result<()> {
        let _ = (done, net);
        if worker.rank != 0 {
            return Ok(());
        }
        record(RecordedModel {
            stage: &mut worker.stage,
            optimizer: &worker.optimizer,
            replicas: &[],
            after_eval: None,
        })
    }

    /// The end of the run on this worker: what its report and the summary add.
    fn finish(
        &mut self,
        worker: &mut Worker<'_>,
        on_event: &mut dyn FnMut(&ringtmp_contract::Event),
    ) -> Result<Ending>;
}

/// Runs one worker of a data-parallel run: opens it, makes its rule (`make`, which may refuse
/// the model), trains every step with the rule's synchronisation, records on rank 0, and ends
/// with the reports. Returns the replica and, on rank 0, the run's summary.
pub fn run<R: SyncRule>(
    opening: &Opening<'_>,
    make: impl FnOnce(&Worker<'_>) -> Result<R>,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<WorkerOutcome> {
    let spec = opening.spec;
    let mut worker = Worker::open(opening, net)?;
    let mut rule = make(&worker)?;
    let mut recorder = crate::replicas::open_recorder(
        spec,
        opening.strategy,
        opening.rank,
        worker.stage.params().len(),
        rule.start_fields(&worker),
        on_event,
    )?;
    let clock = Arc::clone(&worker.clock);
    let global = (spec.batch_size * opening.workers) as u64;
    let mut ran = Ran {
        started: clock.now(),
        train_seconds: 0.0,
        samples: 0,
    };
    let mut step = spec.first_step();
    while step < spec.total_steps {
        let t_step = clock.now();
        let mut log = Log {
            recorder: recorder.as_mut(),
            on_event: &mut *on_event,
        };
        let stepped = rule.step(&mut worker, step, net, &mut log)?;
        ran.train_seconds += (clock.now() - t_step).as_secs_f64();
        let (loss, lr) = match stepped {
            Stepped::Redo { from } => {
                step = from;
                continue;
            }
            Stepped::Trained { loss, lr, next } => {
                if let Some(loss) = loss.filter(|l| !l.is_finite()) {
                    return Err(Error::Diverged { step, loss });
                }
                step = next;
                (loss, lr)
            }
        };
        ran.samples += global;
        net.step_done();
        let record = Record {
            strategy: opening.strategy,
            done: step,
            loss,
            lr,
        };
        record.write(
            &mut rule,
            &mut worker,
            &ran,
            recorder.as_mut(),
            net,
            on_event,
        )?;
    }
    let ending = rule.finish(&mut worker, on_event)?;
    let summary = report(opening, &worker, ending, &ran, recorder, net, on_event)?;
    Ok(WorkerOutcome {
        stage: worker.stage,
        summary,
    })
}

/// The loop's running totals.
struct Ran {
    /// When the run started, on the training clock.
    started: Duration,
    /// Seconds on the training clock.
    train_seconds: f64,
    /// Samples of the global batches trained.
    samples: u64,
}

/// What the loop records after a step.
struct Record {
    strategy: &'static str,
    done: u64,
    loss: Option<f64>,
    lr: f32,
}

impl Record {
    /// Rank 0's step line; then, when due, the evaluation and the checkpoint of the rule's
    /// model (every worker takes part, for a rule that gathers it).
    fn write<R: SyncRule>(
        &self,
        rule: &mut R,
        worker: &mut Worker<'_>,
        ran: &Ran,
        mut recorder: Option<&mut RunRecorder>,
        net: &mut dyn Transport,
        on_event: &mut dyn FnMut(&ringtmp_contract::Event),
    ) -> Result<()> {
        let (spec, data, workers) = (worker.spec, worker.data, worker.workers);
        let done = self.done;
        if let (Some(recorder), Some(loss)) = (recorder.as_mut(), self.loss) {
            recorder.announce_step(
                done,
                loss,
                self.lr,
                (ran.train_seconds, ran.samples),
                on_event,
            )?;
        }
        let (eval, save) = (spec.eval_due(done), spec.checkpoint_due(done));
        if !(eval || save) {
            return Ok(());
        }
        let clock = Arc::clone(&worker.clock);
        rule.with_model(worker, done, net, &mut |model| {
            let recorder = recorder
                .as_mut()
                .expect("rank 0 records the model it evaluates");
            let mut verdict = Verdict::default();
            if eval {
                let score =
                    ringtmp_contract::evaluation::evaluate(model.stage, &data.test, data.classes)?;
                verdict = recorder.announce_eval(
                    done,
                    score,
                    ran.train_seconds,
                    (clock.now() - ran.started).as_secs_f64(),
                    on_event,
                )?;
                if let Some(event) = model.after_eval {
                    recorder.write(event)?;
                }
            }
            if save || verdict.checkpoint {
                let dir = crate::replicas::write_model(
                    spec,
                    workers,
                    self.strategy,
                    model.stage,
                    model.optimizer,
                    done,
                    model.replicas,
                )?;
                recorder.announce_checkpoint(done, dir, on_event)?;
            }
            Ok(())
        })
    }
}

/// The end of the run: every worker's report goes to rank 0 (the rule's survivors'), which
/// writes the run's summary (its wall time since the start, measured after the reports) and
/// returns it.
fn report(
    opening: &Opening<'_>,
    worker: &Worker<'_>,
    ending: Ending,
    ran: &Ran,
    recorder: Option<RunRecorder>,
    net: &mut dyn Transport,
    on_event: &mut dyn FnMut(&ringtmp_contract::Event),
) -> Result<Option<ringtmp_metrics::Summary>> {
    let spec = opening.spec;
    let mut own = crate::replicas::worker_summary(
        opening.rank,
        &worker.stage,
        &worker.optimizer,
        net,
        &WorkerClock {
            train_seconds: ran.train_seconds,
            compute_seconds: worker.compute_seconds,
            wait_seconds: worker.wait_seconds,
            iterations: worker.iterations,
            samples: worker.own_samples,
        },
    );
    own.optimizer_bytes += ending.extra_optimizer_bytes;
    own.test_accuracy = ending.own_accuracy;
    let Some(per_node) = crate::replicas::gather_reports(
        net,
        opening.rank,
        &ending.members,
        own,
        spec.recv_timeout(),
        on_event,
    )?
    else {
        return Ok(None);
    };
    let Some(recorder) = recorder else {
        unreachable!("rank 0 gathers the reports and holds the recorder")
    };
    let totals = crate::replicas::RunTotals {
        params: worker.stage.params().len() as u64,
        steps: spec.total_steps,
        samples: ran.samples,
        samples_from_reports: ending.samples_from_reports,
        wall_seconds: (net.clock().now() - ran.started).as_secs_f64(),
        train_seconds: ran.train_seconds,
    };
    let summary = ringtmp_metrics::Summary {
        dropped_nodes: ending.dropped,
        consensus_distance: ending.consensus_distance,
        ..crate::replicas::run_summary(
            &recorder,
            opening.strategy,
            opening.workers as u32,
            &totals,
            per_node,
        )
    };
    Ok(Some(recorder.finish(summary)?))
}
