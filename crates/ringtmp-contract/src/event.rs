//! What a run reports to its caller while it trains (the CLI draws it): every strategy's
//! driver emits the same events, so one display serves them all.

/// Progress reported to the caller (the CLI draws it).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Training is about to start.
    Started {
        /// Steps the run will take in total.
        total_steps: u64,
        /// Step resumed from (0 for a fresh run).
        first_step: u64,
        /// Parameters in the whole model.
        params: usize,
        /// Parameters of each stage, in ring order, when the model is split (else empty).
        stage_params: Vec<usize>,
    },
    /// An optimizer step finished.
    Step {
        /// Steps completed.
        step: u64,
        /// Epoch of that step.
        epoch: u64,
        /// Mean training loss of the step's mini-batch.
        loss: f64,
        /// Training examples per training second so far.
        samples_per_second: f64,
    },
    /// An evaluation on the test split finished.
    Eval {
        /// Steps completed.
        step: u64,
        /// Epoch in progress.
        epoch: u64,
        /// Test accuracy (regression: R²).
        accuracy: f64,
        /// Mean test loss.
        loss: f64,
        /// Regression: the root mean squared error of an output, in the target's units.
        rmse: Option<f64>,
        /// Regression: the mean absolute error of an output, in the target's units.
        mae: Option<f64>,
    },
    /// Something the run handled and went on from, for the user to know (a worker that left
    /// and was dropped, a ring re-formed around a dead node).
    Notice {
        /// What happened, a sentence naming the nodes.
        text: String,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// Steps completed.
        step: u64,
        /// Its directory.
        path: std::path::PathBuf,
    },
}
