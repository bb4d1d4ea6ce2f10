//! The single-process reference: `local` trains the whole model, and its final parameters are
//! what every distributed strategy must reproduce (within a tolerance) on the same seed and data.

use std::path::Path;

use ringtmp_data::Dataset;
use ringtmp_model::{Optimizer, Stage, checkpoint};
use ringtmp_strategy::{TrainConfig, train_local};

/// Trains `cfg` with `local` (checkpointing at its last step, into `cfg.out`) and returns the
/// final parameters.
///
/// # Panics
/// If training fails (a bug in the test or the code under test).
pub fn local_params(cfg: &TrainConfig, data: &Dataset) -> Vec<f32> {
    let mut cfg = cfg.clone();
    let steps = cfg.max_steps.unwrap_or(u64::MAX);
    let per_epoch = (data.train.len() / cfg.batch_size) as u64;
    cfg.checkpoint_every = steps.min(cfg.schedule_steps(per_epoch, cfg.batch_size));
    train_local(&cfg, data, &mut |_| {}).expect("the local oracle trains");
    checkpoint_params(&cfg.out, &cfg, data)
}

/// The parameters of the newest checkpoint in `out` (written by any strategy), as one vector in
/// layer order.
///
/// # Panics
/// If there is no readable checkpoint.
pub fn checkpoint_params(out: &Path, cfg: &TrainConfig, data: &Dataset) -> Vec<f32> {
    let dir = checkpoint::resolve(out).expect("a checkpoint");
    let manifest = checkpoint::read_manifest(&dir).expect("its manifest");

    let layers = ringtmp_strategy::layers_for(&cfg.model, data).expect("the model builds");
    let mut stage = Stage::new(&layers, 0..layers.len(), 999, 1);
    let mut opt = Optimizer::new(cfg.optimizer.clone(), stage.params().len());
    checkpoint::read_stage(&dir, &manifest, &mut stage, &mut opt).expect("the checkpoint loads");
    stage.params().to_vec()
}
