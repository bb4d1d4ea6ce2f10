//! Gradient clipping by the global L2 norm, as PyTorch's `clip_grad_norm_`: the factor, and
//! clipping a stage that holds the whole gradient (one process, or a replica holding the
//! averaged one). The ring's stages each hold a share; `ring::run::master` sums their norms.

use ringtmp_model::Stage;

/// The factor that brings a gradient of global L2 norm `norm` down to `max_norm` (1 when it is
/// already within): PyTorch's `clip_grad_norm_`, `max_norm / (norm + 1e-6)` clamped to 1.
pub fn clip_factor(norm: f64, max_norm: f32) -> f32 {
    (f64::from(max_norm) / (norm + 1e-6)).min(1.0) as f32
}

/// Scales `stage`'s whole gradient to at most `max_norm`; returns the norm it had.
pub fn clip_whole(stage: &mut Stage, max_norm: f32) -> f64 {
    let norm = stage.grad_norm_squared().sqrt();
    stage.scale_grads(clip_factor(norm, max_norm));
    norm
}
