//! Single-thread f32 GEMM rate of the kernels the layers use (`kernels::matmul`, the `gemm`
//! crate's micro-kernels), at the shapes and by the method of `benches/reference/torch_gemm.py`,
//! so the two compare like for like: `C[m×n] = A[m×k]·B[k×n]`, both operands as stored, the best
//! of 7 rounds of 200 products after 50 untimed ones.
//!
//! ```sh
//! cargo run --release -p ringtmp-model --example gemm_rate
//! cargo run --release -p ringtmp-model --no-default-features --target-dir target/avx2 \
//!     --example gemm_rate                                   # the AVX2 kernels
//! ```
//! Run it alternately with the Python script: only rates taken side by side compare here.

use std::time::Instant;

use ringtmp_model::kernels::{Op, gemm_kernel, matmul};

/// `(label, m, n, k)`, as in `torch_gemm.py`.
const SHAPES: [(&str, usize, usize, usize); 5] = [
    ("256^3 (bench-compute's reference)", 256, 256, 256),
    ("cnn conv2 forward, two samples", 128, 64, 800),
    ("cnn conv2 weight gradient, two samples", 800, 64, 128),
    ("cnn conv2 column gradient, two samples", 128, 800, 64),
    ("linear input gradient 1024->1024, batch 64", 64, 1024, 1024),
];

fn main() {
    println!("{}", gemm_kernel());
    for (label, m, n, k) in SHAPES {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut c = vec![0.0f32; m * n];
        let mut product = || matmul(&mut c, m, n, k, &a, Op::N, &b, Op::N, false, 1);
        for _ in 0..50 {
            product();
        }
        let best = (0..7)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..200 {
                    product();
                }
                start.elapsed().as_secs_f64() / 200.0
            })
            .fold(f64::INFINITY, f64::min);
        let gflops = 2.0 * (m * n * k) as f64 / best / 1e9;
        println!("{label:40} {:8.1} us {gflops:6.1} GFLOP/s", best * 1e6);
    }
}
