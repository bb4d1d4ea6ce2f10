//! The Llama family's gated MLP activation, `SiLU(gate) · up` with `SiLU(g) = g · σ(g)`, and
//! its derivative. The exponential is computed in `f32` arithmetic (Cephes' `expf`: a power of
//! two times a polynomial on `[−ln 2 / 2, ln 2 / 2]`) rather than by libm's `expf`, a call a
//! value that keeps the loops from vectorising (3% of a prompt's prefill went there); the
//! loops are compiled for the CPU's vector width.
//!
//! Invariants: [`exp`] is within 2 units in the last place of the exact value for inputs in
//! `[−87, 88]` (below, it gives ~0 — the smallest normal at most; above, it saturates at
//! `e^88.7`); the forward and the backward use the same [`sigmoid`].

/// `e^x` (see the module's invariants).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, the first exact in few bits, so that `x − n·ln 2` loses nothing.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.336_55, 88.722_83);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    // 2ⁿ from its exponent bits; `n` is in −126..=128, and 2¹²⁸ is taken as 2¹²⁷ · 2. `n`
    // as an integer by adding 1.5 · 2²³, which leaves it in the mantissa's low bits (a cast
    // would check each lane for NaN and keep the loop from vectorising).
    const SHIFT: f32 = 12_582_912.0;
    let n = (n + SHIFT).to_bits() as i32 - SHIFT.to_bits() as i32;
    let half = n >> 1;
    let two = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    e * two(half) * two(n - half)
}

/// `1 / (1 + e^−x)`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `out[i] = gate[i] · σ(gate[i]) · up[i]`.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn forward(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g * sigmoid(g) * u;
    }
}

/// The gradients of the gate and up halves from the output's, `dm`.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn backward(gate: &[f32], up: &[f32], dm: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    for i in 0..dm
        .len()
        .min(gate.len())
        .min(up.len())
        .min(dgate.len())
        .min(dup.len())
    {
        let (g, s) = (gate[i], sigmoid(gate[i]));
        dup[i] = dm[i] * g * s;
        dgate[i] = dm[i] * up[i] * s * (1.0 + g * (1.0 - s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_units_in_the_last_place() {
        let mut worst = 0.0f64;
        let steps = 2_000_000;
        for i in 0..=steps {
            let x = -87.0 + 175.0 * i as f32 / steps as f32;
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} units in the last place");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-100.0) <= f32::MIN_POSITIVE && exp(-100.0) >= 0.0);
        assert!(exp(100.0).is_finite() && exp(100.0) > 1e38);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn swiglu_and_its_gradient_match_the_libm_formula() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let up: Vec<f32> = (0..1000)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.3)
            .collect();
        let dm: Vec<f32> = (0..1000)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2)
            .collect();
        let mut out = vec![0.0; 1000];
        forward(&gate, &up, &mut out);
        let (mut dg, mut du) = (vec![0.0; 1000], vec![0.0; 1000]);
        backward(&gate, &up, &dm, &mut dg, &mut du);
        for i in 0..1000 {
            let (g, u, d) = (f64::from(gate[i]), f64::from(up[i]), f64::from(dm[i]));
            let s = 1.0 / (1.0 + (-g).exp());
            let close = |a: f32, b: f64| (f64::from(a) - b).abs() <= 1e-6 * (1.0 + b.abs());
            assert!(close(out[i], g * s * u), "forward at {g}");
            assert!(close(du[i], d * g * s), "up's gradient at {g}");
            assert!(
                close(dg[i], d * u * s * (1.0 + g * (1.0 - s))),
                "gate's gradient at {g}"
            );
        }
    }
}
