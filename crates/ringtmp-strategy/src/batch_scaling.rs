//! How the defaults tuned for one node's batch carry over to a step that averages several
//! batches: data-parallel workers, a parameter server's iteration (synchronous or stale), rings
//! of rings that average their gradients. The user's own choices are never changed; only
//! defaults are scaled.
//!
//! - SGD's rate scales linearly with the batches averaged (Goyal et al., 2017: the per-example
//!   step stays the same).
//! - Adam's and AdamW's rate scales with the square root (Malladi et al., "On the SDEs and
//!   scaling rules for adaptive gradient algorithms", NeurIPS 2022): an adaptive step is
//!   normalised by the gradient's second moment, whose noise falls with the square root of the
//!   batch.
//! - Warm-up spans the same number of examples: its default steps are divided by the batches
//!   averaged (rounded up), so a 4-worker run does not spend four times the data warming up.
//! - A linearly scaled SGD rate warms up over its first [`SCALED_SGD_WARMUP_STEPS`] steps when
//!   the defaults have none (Goyal et al.'s gradual warm-up): without it the 4-worker cnn's
//!   first steps at 4 × 0.01 with momentum 0.9 threw it to 93.95% after an epoch where 10
//!   steps of warm-up reach 98.26% (and the mlp 97.02% against 97.06%).
//!
//! Measured by `benches/defaults_sweep.sh` (docs/decisions/defaults.md).

use ringtmp_model::OptimizerConfig;

use crate::TrainConfig;

/// Steps of linear warm-up a linearly scaled default SGD rate gets when the defaults have none.
pub const SCALED_SGD_WARMUP_STEPS: u64 = 10;

/// How the updates of a step that averages several batches reach the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Updates {
    /// One update of the batches' mean gradient (all-reduce, BSP, gossip, rings of rings).
    Synchronous,
    /// One update per batch, each computed from parameters some updates old (the parameter
    /// server's ASP, SSP and DSSP).
    Stale,
}

/// Scales `cfg`'s default rate and warm-up for a step that averages `batches` batches of
/// `cfg.batch_size`; returns what it changed, for the plan's notes (`None`: nothing).
///
/// Under [`Updates::Stale`] Adam's and AdamW's rate is the one-node rate ÷ W instead: delayed
/// adaptive steps need smaller rates, as delayed momentum does. Measured on `gpt-cpu` with 4
/// workers under ssp:2: validation loss 2.320 and 2.322 at 1e-3 and 2e-3 a step, 2.469 at the
/// one-node 4e-3, 2.501 at the synchronous √W rule's 8e-3.
pub fn scale_defaults(cfg: &mut TrainConfig, batches: usize, updates: Updates) -> Option<String> {
    if batches <= 1 {
        return None;
    }
    let mut changed = Vec::new();
    if cfg.default_lr {
        let (factor, rule) = match (&cfg.optimizer, updates) {
            (OptimizerConfig::Sgd { .. }, _) => (batches as f32, "linear scaling"),
            (_, Updates::Synchronous) => ((batches as f32).sqrt(), "square-root scaling for Adam"),
            (_, Updates::Stale) => (1.0 / batches as f32, "Adam's rate under stale updates"),
        };
        cfg.lr *= factor;
        changed.push(format!(
            "learning rate {} ({rule}: ×{factor:.3} for {batches} batches a step)",
            cfg.lr
        ));
    }
    if cfg.default_warmup && cfg.warmup_steps > 0 {
        cfg.warmup_steps = cfg.warmup_steps.div_ceil(batches as u64);
        changed.push(format!(
            "{} warm-up steps (the default's examples at {batches} batches a step)",
            cfg.warmup_steps
        ));
    } else if cfg.default_warmup
        && cfg.default_lr
        && matches!(cfg.optimizer, OptimizerConfig::Sgd { .. })
    {
        cfg.warmup_steps = SCALED_SGD_WARMUP_STEPS;
        changed.push(format!(
            "{SCALED_SGD_WARMUP_STEPS} warm-up steps (gradual warm-up of the scaled rate)"
        ));
    }
    (!changed.is_empty()).then(|| changed.join("; "))
}
