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
    if cfg.lr.is_default() {
        let (factor, rule) = match (&cfg.optimizer, updates) {
            (OptimizerConfig::Sgd { .. }, _) => (batches as f32, "linear scaling"),
            (_, Updates::Synchronous) => ((batches as f32).sqrt(), "square-root scaling for Adam"),
            (_, Updates::Stale) => (1.0 / batches as f32, "Adam's rate under stale updates"),
        };
        cfg.lr.adapt(|lr| lr * factor);
        changed.push(format!(
            "learning rate {} ({rule}: ×{factor:.3} for {batches} batches a step)",
            cfg.lr
        ));
    }
    if cfg.warmup_steps.is_default() && *cfg.warmup_steps > 0 {
        cfg.warmup_steps.adapt(|w| w.div_ceil(batches as u64));
        changed.push(format!(
            "{} warm-up steps (the default's examples at {batches} batches a step)",
            cfg.warmup_steps
        ));
    } else if cfg.warmup_steps.is_default()
        && cfg.lr.is_default()
        && matches!(cfg.optimizer, OptimizerConfig::Sgd { .. })
    {
        cfg.warmup_steps.adapt(|_| SCALED_SGD_WARMUP_STEPS);
        changed.push(format!(
            "{SCALED_SGD_WARMUP_STEPS} warm-up steps (gradual warm-up of the scaled rate)"
        ));
    }
    (!changed.is_empty()).then(|| changed.join("; "))
}

#[cfg(test)]
mod tests {
    use ringtmp_model::{LrSchedule, ModelSpec};

    use super::*;
    use crate::defaulted::{Defaulted, Origin};

    /// The CLI's defaults for `optimizer`: rate 0.01 (SGD) or 0.001, warm-up `warmup`, every
    /// setting marked as a default.
    fn defaults(optimizer: OptimizerConfig, warmup: u64) -> TrainConfig {
        let lr = match optimizer {
            OptimizerConfig::Sgd { .. } => 0.01,
            _ => 0.001,
        };
        TrainConfig {
            model: ModelSpec::preset("mlp", 10).unwrap(),
            dataset: "mnist".into(),
            wire_dtype: ringtmp_wire::Dtype::F32,
            data_dir: None,
            epochs: 1,
            batch_size: 64,
            lr: Defaulted::default_value(lr),
            schedule: Defaulted::default_value(LrSchedule::Constant),
            warmup_steps: Defaulted::default_value(warmup),
            momentum: Origin::Default,
            optimizer,
            threads: 1,
            seed: 1,
            target_accuracy: 0.97,
            eval_every: 0,
            out: "out".into(),
            checkpoint_every: 0,
            keep_checkpoints: None,
            resume: None,
            max_steps: None,
            train_samples: None,
            min_samples: None,
            keep_best: false,
            early_stop: None,
            recv_timeout_secs: 30.0,
            stall_timeout_secs: None,
            clip_grad_norm: None,
            text: None,
            source: None,
            init_from: None,
            threads_from_machine: false,
        }
    }

    fn sgd() -> OptimizerConfig {
        OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        }
    }

    fn adam() -> OptimizerConfig {
        OptimizerConfig::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    #[test]
    fn a_scaled_default_sgd_rate_without_warm_up_gets_its_ten_steps() {
        let mut cfg = defaults(sgd(), 0);
        let said = scale_defaults(&mut cfg, 4, Updates::Synchronous).unwrap();
        assert!((*cfg.lr - 0.04).abs() < 1e-9, "{}", cfg.lr);
        assert_eq!(*cfg.warmup_steps, SCALED_SGD_WARMUP_STEPS);
        assert!(
            said.contains("linear scaling") && said.contains("10 warm-up steps"),
            "{said}"
        );
        // The user's own rate: neither it nor the warm-up changes.
        let mut cfg = defaults(sgd(), 0);
        cfg.lr = Defaulted::given(*cfg.lr);
        assert_eq!(scale_defaults(&mut cfg, 4, Updates::Synchronous), None);
        assert_eq!((*cfg.lr, *cfg.warmup_steps), (0.01, 0));
        // The user's own warm-up of 0 stays 0 under the scaled rate.
        let mut cfg = defaults(sgd(), 0);
        cfg.warmup_steps = Defaulted::given(*cfg.warmup_steps);
        scale_defaults(&mut cfg, 4, Updates::Synchronous).unwrap();
        assert_eq!(*cfg.warmup_steps, 0);
    }

    #[test]
    fn adam_scales_by_the_square_root_or_divides_under_stale_updates() {
        let mut cfg = defaults(adam(), 100);
        scale_defaults(&mut cfg, 4, Updates::Synchronous).unwrap();
        assert!((*cfg.lr - 0.002).abs() < 1e-9, "{}", cfg.lr);
        // A default warm-up spans the same examples: 100 steps of one batch, 25 of four.
        assert_eq!(*cfg.warmup_steps, 25);
        let mut cfg = defaults(adam(), 0);
        scale_defaults(&mut cfg, 4, Updates::Stale).unwrap();
        assert!((*cfg.lr - 0.00025).abs() < 1e-9, "{}", cfg.lr);
        assert_eq!(
            *cfg.warmup_steps, 0,
            "only a scaled SGD rate gets the ten steps"
        );
        // One batch a step: nothing to scale.
        let mut cfg = defaults(sgd(), 0);
        assert_eq!(scale_defaults(&mut cfg, 1, Updates::Synchronous), None);
        assert_eq!(*cfg.lr, 0.01);
    }
}
