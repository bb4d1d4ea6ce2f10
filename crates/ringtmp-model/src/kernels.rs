//! Dense kernels shared by the layers: a GEMM front-end over the `gemm` crate and a few
//! element-wise helpers.
//!
//! All matrices are row-major `f32` slices. Transposes are expressed through strides, which `gemm`
//! accepts directly, so no layer ever materialises a transposed copy.

use gemm_common::Parallelism;
use multiversion::multiversion;
use rayon::prelude::*;

/// How a GEMM operand is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Use the matrix as stored.
    N,
    /// Use the transpose of the stored matrix.
    T,
}

/// `c[m×n] = (accumulate ? c : 0) + op_a(a)[m×k] · op_b(b)[k×n]`.
///
/// `a` is stored `[m, k]` for [`Op::N`] and `[k, m]` for [`Op::T`]; `b` is stored `[k, n]` for
/// [`Op::N`] and `[n, k]` for [`Op::T`].
///
/// # Panics
/// If a slice is shorter than its dimensions require (a programmer error inside this crate; it
/// guards the unsafe call below).
pub fn matmul(
    c: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    op_a: Op,
    b: &[f32],
    op_b: Op,
    accumulate: bool,
    threads: usize,
) {
    assert!(
        c.len() >= m * n,
        "matmul: c has {} values, needs {}",
        c.len(),
        m * n
    );
    assert!(
        a.len() >= m * k,
        "matmul: a has {} values, needs {}",
        a.len(),
        m * k
    );
    assert!(
        b.len() >= k * n,
        "matmul: b has {} values, needs {}",
        b.len(),
        k * n
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    let (a_rs, a_cs) = match op_a {
        Op::N => (k, 1),
        Op::T => (1, m),
    };
    let (b_rs, b_cs) = match op_b {
        Op::N => (n, 1),
        Op::T => (1, k),
    };
    let parts = threads
        .min(if n >= m {
            n / SPLIT_ALIGN
        } else {
            m / SPLIT_ALIGN
        })
        .max(1);
    let c_ptr = SendPtr(c.as_mut_ptr());
    let (a_ptr, b_ptr) = (
        SendPtr(a.as_ptr().cast_mut()),
        SendPtr(b.as_ptr().cast_mut()),
    );
    if parts == 1 || m * n * k < PARALLEL_MIN_FLOPS {
        // SAFETY: the asserts above guarantee every element addressed by (rows, cols, strides)
        // lies inside its slice; `c` is uniquely borrowed and does not alias `a` or `b`.
        unsafe {
            gemm_raw(
                m, n, k, c_ptr.0, n, a_ptr.0, a_rs, a_cs, b_ptr.0, b_rs, b_cs, accumulate,
            )
        };
        return;
    }
    // Split C into `parts` disjoint blocks along its larger dimension and run one single-threaded
    // GEMM per block. On these 2-core machines this scales better than `gemm`'s internal rayon
    // parallelism (measured by `ringtmp bench-compute`; see docs/BENCHMARKS.md).
    let split_n = n >= m;
    let len = if split_n { n } else { m };
    let block = len.div_ceil(parts).next_multiple_of(SPLIT_ALIGN);
    let blocks = len.div_ceil(block);
    (0..blocks).into_par_iter().for_each(|i| {
        let (start, end) = (i * block, ((i + 1) * block).min(len));
        let (c_ptr, a_ptr, b_ptr) = (&c_ptr, &a_ptr, &b_ptr);
        // SAFETY: blocks are disjoint ranges of C's rows or columns, so no two tasks write the
        // same element; every offset stays inside the slices checked above.
        unsafe {
            if split_n {
                let b_off = if op_b == Op::N { start } else { start * k };
                gemm_raw(
                    m,
                    end - start,
                    k,
                    c_ptr.0.add(start),
                    n,
                    a_ptr.0,
                    a_rs,
                    a_cs,
                    b_ptr.0.add(b_off),
                    b_rs,
                    b_cs,
                    accumulate,
                );
            } else {
                let a_off = if op_a == Op::N { start * k } else { start };
                gemm_raw(
                    end - start,
                    n,
                    k,
                    c_ptr.0.add(start * n),
                    n,
                    a_ptr.0.add(a_off),
                    a_rs,
                    a_cs,
                    b_ptr.0,
                    b_rs,
                    b_cs,
                    accumulate,
                );
            }
        }
    });
}

/// Rows `rows` of `c[m×n] (+)= aᵀ·b`, for `a` stored `[k, m]` and `b` stored `[k, n]`, into
/// `c_rows` (`rows.len() × n`, row-major), on the calling thread. Each value is the same sum in
/// the same order as the whole product's ([`matmul`] with [`Op::T`], [`Op::N`]), so a weight
/// gradient made block by block has the bits of one made at once.
///
/// # Panics
/// If a slice is shorter than its dimensions require or `rows` ends past `m`.
pub fn matmul_tn_rows(
    c_rows: &mut [f32],
    rows: std::ops::Range<usize>,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    b: &[f32],
    accumulate: bool,
) {
    let height = rows.len();
    assert!(
        rows.end <= m && c_rows.len() >= height * n && a.len() >= k * m && b.len() >= k * n,
        "matmul_tn_rows: bad lengths"
    );
    if height == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c_rows[..height * n].fill(0.0);
        }
        return;
    }
    // SAFETY: logical row i < height of aᵀ starts at a[rows.start + i] with columns m apart, the
    // last element read being a[(k−1)·m + rows.end − 1] < k·m ≤ a.len(); `b` and `c_rows` were
    // checked above; `c_rows` is uniquely borrowed and does not alias `a` or `b`.
    unsafe {
        gemm_raw(
            height,
            n,
            k,
            c_rows.as_mut_ptr(),
            n,
            a.as_ptr().add(rows.start),
            1,
            m,
            b.as_ptr(),
            n,
            1,
            accumulate,
        )
    };
}

/// Rows up to which [`linear_forward`] computes through a column-major temporary (faster at 16,
/// 64 and 256 rows on these machines, slower at 1,024: `ringtmp bench-compute --batch-size N`).
pub const FEW_ROWS: usize = 512;

thread_local! {
    /// Column-major temporary of [`linear_forward`], reused across calls on each thread.
    static COLUMN_MAJOR: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `y[m×n] = x[m×k] · wᵀ + bias` for weights `w` stored `[n, k]`; an empty `bias` is none (a
/// projection without one, as the Llama family's).
///
/// For few rows (micro-batches), `gemm` would pack the whole weight matrix on every call — as
/// much memory traffic as the product itself. Writing the result column-major instead makes `w`
/// the right-hand operand in its natural layout (contiguous along k), which `gemm` streams without
/// packing; the small result is then transposed into `y`. Measured with `ringtmp bench-compute
/// --batch-size 16` (see docs/BENCHMARKS.md).
pub fn linear_forward(
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    x: &[f32],
    w: &[f32],
    bias: &[f32],
    threads: usize,
) {
    if m > FEW_ROWS || k == 0 {
        if bias.is_empty() {
            matmul(y, m, n, k, x, Op::N, w, Op::T, false, threads);
        } else {
            broadcast_rows(y, bias);
            matmul(y, m, n, k, x, Op::N, w, Op::T, true, threads);
        }
        return;
    }
    assert!(
        y.len() >= m * n
            && x.len() >= m * k
            && w.len() >= n * k
            && (bias.len() == n || bias.is_empty()),
        "linear_forward: bad lengths"
    );
    COLUMN_MAJOR.with(|t| {
        let mut t = t.borrow_mut();
        set_len(&mut t, m * n);
        let parts = threads.min(n / SPLIT_ALIGN).max(1);
        let block = n.div_ceil(parts).next_multiple_of(SPLIT_ALIGN);
        let t_ptr = SendPtr(t.as_mut_ptr());
        let (x_ptr, w_ptr) = (
            SendPtr(x.as_ptr().cast_mut()),
            SendPtr(w.as_ptr().cast_mut()),
        );
        let one = |b: usize| {
            let (j0, j1) = (b * block, ((b + 1) * block).min(n));
            let (t_ptr, x_ptr, w_ptr) = (&t_ptr, &x_ptr, &w_ptr);
            // SAFETY: column blocks j0..j1 of the m×n column-major temporary are disjoint per task;
            // x is m×k row-major, w rows j0..j1 lie inside `w` (checked above).
            unsafe {
                gemm_f32(
                    (m, j1 - j0, k),
                    t_ptr.0.add(j0 * m),
                    (m as isize, 1),
                    false,
                    x_ptr.0,
                    (1, k as isize),
                    w_ptr.0.add(j0 * k),
                    (k as isize, 1),
                );
            }
        };
        let blocks = n.div_ceil(block);
        if blocks > 1 && m * n * k >= PARALLEL_MIN_FLOPS {
            (0..blocks).into_par_iter().for_each(one);
        } else {
            (0..blocks).for_each(one);
        }
        transpose_add_bias(&mut y[..m * n], &t[..m * n], m, n, bias);
    });
}

/// `y[i, j] = t[j·m + i] + bias[j]` (`bias[j]` 0 when `bias` is empty): the row-major `m×n` result from its column-major temporary,
/// tile by tile (16×16), so that a tile's 16 source lines stay in L1 while its rows are written.
/// Row by row, every row read one value from each of `n` cache lines, more than L1 holds: 2.7%
/// of a ring node's samples went to this loop (docs/benchmarks/logs/log-18.md).
fn transpose_add_bias(y: &mut [f32], t: &[f32], m: usize, n: usize, bias: &[f32]) {
    const TILE: usize = 16;
    if bias.is_empty() {
        for i0 in (0..m).step_by(TILE) {
            for j0 in (0..n).step_by(TILE) {
                let j1 = (j0 + TILE).min(n);
                for i in i0..(i0 + TILE).min(m) {
                    for (v, j) in y[i * n + j0..i * n + j1].iter_mut().zip(j0..) {
                        *v = t[j * m + i];
                    }
                }
            }
        }
        return;
    }
    for i0 in (0..m).step_by(TILE) {
        for j0 in (0..n).step_by(TILE) {
            let j1 = (j0 + TILE).min(n);
            for i in i0..(i0 + TILE).min(m) {
                let row = &mut y[i * n + j0..i * n + j1];
                for ((v, b), j) in row.iter_mut().zip(&bias[j0..j1]).zip(j0..) {
                    *v = t[j * m + i] + b;
                }
            }
        }
    }
}

/// Blocks of a split GEMM are multiples of this many rows or columns (one AVX-512 vector of f32).
const SPLIT_ALIGN: usize = 16;
/// Below this many multiply-adds a GEMM runs on one thread: splitting costs more than it saves.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// A raw pointer that may cross to a rayon task (each task touches a disjoint region).
struct SendPtr(*mut f32);
// SAFETY: used only for disjoint writes and shared reads, as argued at each use.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Single-threaded `gemm` on a row-major `m × n` destination with row stride `c_rs`.
///
/// # Safety
/// Every addressed element of `a`, `b` and `c` must be valid, and `c` must not alias `a` or `b`.
unsafe fn gemm_raw(
    m: usize,
    n: usize,
    k: usize,
    c: *mut f32,
    c_rs: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    b_rs: usize,
    b_cs: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm_f32(
            (m, n, k),
            c,
            (1, c_rs as isize),
            accumulate,
            a,
            (a_cs as isize, a_rs as isize),
            b,
            (b_cs as isize, b_rs as isize),
        );
    }
}

/// `dst := (read_dst ? dst : 0) + lhs · rhs` on the calling thread, through `gemm`'s f32 kernels
/// (`gemm-f32`), with the one normalisation of `gemm::gemm` that these strides need: a
/// destination laid out by rows is computed as its transpose, since the micro-kernels write
/// columns. The same kernel and the same operands as `gemm::gemm::<f32>` with alpha and beta 1,
/// so the same bits. Strides are element counts, none negative.
///
/// # Safety
/// Every element addressed through the strides must be valid, and `dst` must not alias `lhs` or
/// `rhs`.
unsafe fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (dst_cs, dst_rs): (isize, isize),
    read_dst: bool,
    lhs: *const f32,
    (lhs_cs, lhs_rs): (isize, isize),
    rhs: *const f32,
    (rhs_cs, rhs_rs): (isize, isize),
) {
    let kernel = gemm_f32::gemm::f32::get_gemm_fn();
    let none = Parallelism::None;
    // SAFETY: forwarded from the caller; the transpose swaps the operands and their strides, so
    // the same elements are addressed.
    unsafe {
        if dst_cs < dst_rs {
            kernel(
                n, m, k, dst, dst_rs, dst_cs, read_dst, rhs, rhs_rs, rhs_cs, lhs, lhs_rs, lhs_cs,
                1.0, 1.0, false, false, false, none,
            )
        } else {
            kernel(
                m, n, k, dst, dst_cs, dst_rs, read_dst, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs,
                1.0, 1.0, false, false, false, none,
            )
        }
    }
}

/// Makes the calling thread flush subnormal floats to zero (x86 MXCSR FTZ and DAZ bits); a no-op
/// on other architectures.
///
/// Late in training, gradients shrink into the subnormal range, where every multiply takes a
/// slow microcode path: measured here, `cnn` throughput fell steadily from 3,370 to 2,990
/// samples/s over two epochs without this. The reference framework flushes subnormals in its
/// compute threads too, so this also keeps comparisons fair. Call it on every thread that runs
/// kernels (rayon's `start_handler` for pool threads).
pub fn flush_denormals() {
    #[cfg(target_arch = "x86_64")]
    {
        const FTZ: u32 = 1 << 15;
        const DAZ: u32 = 1 << 6;
        // SAFETY: reading and writing MXCSR only changes this thread's floating-point modes.
        #[allow(deprecated)]
        unsafe {
            use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
            _mm_setcsr(_mm_getcsr() | FTZ | DAZ);
        }
    }
}

/// The instruction set this CPU runs the kernels with, as both dispatchers choose it at run
/// time: the element-wise and pooling loops (`multiversion`, targets below) and the `gemm`
/// crate's f32 micro-kernels (built with its `x86-v4` feature, so AVX-512 where the CPU has it).
/// Both take the widest of AVX-512 (F, VL, DQ), AVX2 with FMA, and NEON, else the baseline; a
/// build without the `avx512` feature stops at AVX2 with FMA on any CPU.
pub fn simd_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "avx512")
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
        {
            return "avx512";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "avx2+fma";
        }
        "sse2"
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return "neon";
        }
        "baseline"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "baseline"
    }
}

/// Whether this CPU has AVX-512 that the build leaves unused (built without the `avx512`
/// feature, to measure the AVX2 kind's code paths here).
pub fn simd_capped_by_build() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What [`simd_level`] means for the GEMMs: the `gemm` crate's f32 register width.
pub fn gemm_kernel() -> &'static str {
    match simd_level() {
        "avx512" => "gemm 0.19, AVX-512 micro-kernels (16 f32 lanes)",
        "avx2+fma" => "gemm 0.19, AVX2+FMA micro-kernels (8 f32 lanes)",
        "neon" => "gemm 0.19, NEON micro-kernels (4 f32 lanes)",
        _ => "gemm 0.19, baseline micro-kernels",
    }
}

/// Single-thread GFLOP/s of a fixed 256 × 256 × 256 GEMM (median of 15 after a warm-up): a
/// yardstick of this machine's speed right now, so that throughput stored on one day can be
/// compared with throughput measured on another on the same kind of machine, as a ratio to it.
pub fn reference_gflops() -> f64 {
    reference_gflops_of(15)
}

/// [`reference_gflops`] over `repeats` timed products (0.2–0.4 ms each here): short enough to
/// be taken next to every timed repeat of a benchmark, on machines whose speed drifts within
/// seconds.
pub fn reference_gflops_of(repeats: usize) -> f64 {
    const N: usize = 256;
    let a: Vec<f32> = (0..N * N)
        .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
        .collect();
    let b: Vec<f32> = (0..N * N)
        .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let mut c = vec![0.0f32; N * N];
    let mut times = Vec::new();
    for rep in 0..=repeats.max(1) {
        let t = std::time::Instant::now();
        matmul(&mut c, N, N, N, &a, Op::N, &b, Op::N, false, 1);
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    2.0 * (N * N * N) as f64 / times[times.len() / 2] / 1e9
}

// Element-wise kernels. The crate is compiled for the baseline x86-64 (SSE2) so the binary runs on
// any machine; `multiversion` compiles these loops again for AVX2 and AVX-512 and picks the best
// at run time. Before this, ReLU's backward ran as scalar branchy code at ~3 ns per element. The
// AVX-512 versions are compiled only with the `avx512` feature (on by default), so that one
// machine can also measure the code an AVX2-only CPU runs.

/// `y = max(x, 0)`.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn relu_forward(x: &[f32], y: &mut [f32]) {
    for (o, i) in y.iter_mut().zip(x) {
        *o = i.max(0.0);
    }
}

/// `y = max(y, 0)` in place.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn relu_in_place(y: &mut [f32]) {
    for v in y.iter_mut() {
        *v = v.max(0.0);
    }
}

/// `dx = dy` where the ReLU's output `y` is positive, else 0 (written branch-free so it
/// vectorises).
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn relu_backward(y: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((d, g), o) in dx.iter_mut().zip(dy).zip(y) {
        let keep = u32::from(*o > 0.0).wrapping_neg();
        *d = f32::from_bits(g.to_bits() & keep);
    }
}

/// `out = a ⊙ b`.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn multiply(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x * y;
    }
}

/// Fills each of the `rows` rows of `dst` (`[rows, bias.len()]`) with `bias`.
pub fn broadcast_rows(dst: &mut [f32], bias: &[f32]) {
    for row in dst.chunks_exact_mut(bias.len()) {
        row.copy_from_slice(bias);
    }
}

/// `out[j] = (accumulate ? out[j] : 0) + Σ_i m[i, j]` for a row-major `m` with `out.len()` columns.
#[cfg_attr(
    feature = "avx512",
    multiversion(targets("x86_64+avx512f+avx512vl+avx512dq", "x86_64+avx2+fma", "aarch64+neon"))
)]
#[cfg_attr(
    not(feature = "avx512"),
    multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))
)]
pub fn column_sums(out: &mut [f32], m: &[f32], accumulate: bool) {
    if out.is_empty() {
        return;
    }
    if !accumulate {
        out.fill(0.0);
    }
    for row in m.chunks_exact(out.len()) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
}

/// Resizes `v` to `len` values. Contents are unspecified afterwards: callers overwrite them.
/// Keeping the old values instead of zeroing saves a memory pass in the steady state, where the
/// length never changes and no allocation happens.
pub fn set_len(v: &mut Vec<f32>, len: usize) {
    if v.is_empty() && len > 0 {
        // A fresh buffer comes from the allocator already zeroed (`calloc`: large ones are
        // mapped lazily), not written value by value: a sizes-only simulation's stashed weight
        // versions then cost no memory (256 nodes of a 107 MB stage ran out of 24 GB).
        *v = vec![0.0; len];
    } else if v.len() != len {
        v.resize(len, 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The dispatchers choose the widest instruction set the CPU has, and on aarch64
    // (a board, or qemu-user in CI) that is NEON: the paths checked below are its own there.
    #[test]
    fn simd_level_is_the_widest_this_cpu_has() {
        let level = simd_level();
        #[cfg(target_arch = "aarch64")]
        assert_eq!(level, "neon", "every aarch64 Linux CPU has Advanced SIMD");
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512dq");
            let avx512 = avx512 && cfg!(feature = "avx512");
            let expected = match (avx512, avx2) {
                (true, _) => "avx512",
                (false, true) => "avx2+fma",
                _ => "sse2",
            };
            assert_eq!(level, expected);
        }
        assert!(gemm_kernel().starts_with("gemm 0.19"), "{}", gemm_kernel());
    }

    /// Values with both signs, zeros of both signs and magnitudes far apart.
    fn mixed(len: usize, salt: usize) -> Vec<f32> {
        (0..len)
            .map(|i| match (i * 7 + salt) % 11 {
                0 => 0.0,
                1 => -0.0,
                r => (r as f32 - 5.5) * 10f32.powi((i % 5) as i32 - 2),
            })
            .collect()
    }

    // The element-wise kernels, at whatever SIMD level runs them (AVX-512, AVX2,
    // NEON), equal the plain scalar loop bit for bit at every tail length of every vector width.
    #[test]
    fn element_wise_kernels_match_the_scalar_loop_at_every_tail_length() {
        for len in 0..70 {
            let (x, g) = (mixed(len, 0), mixed(len, 3));
            let mut y = vec![f32::NAN; len];
            relu_forward(&x, &mut y);
            let want: Vec<f32> = x.iter().map(|v| if *v > 0.0 { *v } else { 0.0 }).collect();
            assert_eq!(bits(&y), bits(&want), "relu_forward, {len} values");
            let mut z = x.clone();
            relu_in_place(&mut z);
            assert_eq!(bits(&z), bits(&want), "relu_in_place, {len} values");
            let mut dx = vec![f32::NAN; len];
            relu_backward(&x, &g, &mut dx);
            let want: Vec<f32> = x
                .iter()
                .zip(&g)
                .map(|(o, d)| if *o > 0.0 { *d } else { 0.0 })
                .collect();
            assert_eq!(bits(&dx), bits(&want), "relu_backward, {len} values");
            let mut out = vec![f32::NAN; len];
            multiply(&x, &g, &mut out);
            let want: Vec<f32> = x.iter().zip(&g).map(|(a, b)| a * b).collect();
            assert_eq!(bits(&out), bits(&want), "multiply, {len} values");
            for cols in [1, 3, 16, 17] {
                let rows = len / cols;
                let m = &x[..rows * cols];
                let mut sums = vec![1.0f32; cols];
                column_sums(&mut sums, m, true);
                let mut want = vec![1.0f32; cols];
                for row in m.chunks_exact(cols) {
                    for (w, v) in want.iter_mut().zip(row) {
                        *w += v;
                    }
                }
                assert_eq!(bits(&sums), bits(&want), "column_sums, {rows}×{cols}");
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn naive(m: usize, n: usize, k: usize, a: &[f32], ta: Op, b: &[f32], tb: Op) -> Vec<f32> {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for l in 0..k {
                    let av = if ta == Op::N {
                        a[i * k + l]
                    } else {
                        a[l * m + i]
                    };
                    let bv = if tb == Op::N {
                        b[l * n + j]
                    } else {
                        b[j * k + l]
                    };
                    s += av as f64 * bv as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    #[test]
    fn matmul_matches_naive_for_every_transpose_combination() {
        let (m, n, k) = (70, 50, 90);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 17) % 7) as f32 - 3.0).collect();
        for ta in [Op::N, Op::T] {
            for tb in [Op::N, Op::T] {
                for threads in [1, 2, 3] {
                    let want = naive(m, n, k, &a, ta, &b, tb);
                    let mut c = vec![1.0f32; m * n];
                    matmul(&mut c, m, n, k, &a, ta, &b, tb, false, threads);
                    assert_eq!(c, want, "{ta:?}{tb:?} overwrite");
                    matmul(&mut c, m, n, k, &a, ta, &b, tb, true, threads);
                    let doubled: Vec<f32> = want.iter().map(|v| 2.0 * v).collect();
                    assert_eq!(c, doubled, "{ta:?}{tb:?} accumulate");
                }
            }
        }
    }

    #[test]
    fn linear_forward_agrees_with_the_general_path() {
        // Shapes off the transpose's 16×16 tiles too.
        for (m, n, k) in [(3, 40, 17), (16, 64, 33), (130, 20, 9), (37, 1000, 5)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 17) % 7) as f32 - 3.0).collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32).collect();
            let mut want = naive(m, n, k, &x, Op::N, &w, Op::T);
            for (i, v) in want.iter_mut().enumerate() {
                *v += bias[i % n];
            }
            for threads in [1, 2] {
                let mut y = vec![f32::NAN; m * n];
                linear_forward(&mut y, m, n, k, &x, &w, &bias, threads);
                assert_eq!(y, want, "{m}×{n}×{k}, {threads} threads");
            }
        }
    }

    #[test]
    fn column_sums_accumulates_over_rows() {
        let m = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [10.0, 20.0, 30.0];
        column_sums(&mut out, &m, true);
        assert_eq!(out, [15.0, 27.0, 39.0]);
        column_sums(&mut out, &m, false);
        assert_eq!(out, [5.0, 7.0, 9.0]);
    }
}
