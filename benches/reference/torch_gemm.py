#!/usr/bin/env python3
"""Single-thread f32 GEMM rate of PyTorch's CPU backend (MKL) at the shapes of the project's
layers, next to the `gemm` crate's: `ringtmp bench-compute` prints the crate's rate on the same
256 x 256 x 256 product ("reference 256³ GEMM on one thread") before its table.

Not a project dependency: `pip install torch numpy`. From the repository root:
    python3 benches/reference/torch_gemm.py
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python3 benches/reference/torch_gemm.py          # the AVX2 machine kind's instruction set
    target/release/ringtmp bench-compute --models mlp --threads 1 --repeats 1 | head -1

Run the two alternately, a few times: these machines' speed drifts from minute to minute, so
only rates taken side by side compare (docs/benchmarks/logs/log-15.md: 82.5-84.3 GFLOP/s here
against the crate's 83.6-84.0 on AVX2).

Each shape: the best of 7 rounds of 200 products after 50 untimed ones, into a preallocated
output.
"""
import time

import torch

# (label, m, n, k): C[m x n] = A[m x k] B[k x n].
SHAPES = [
    ("256^3 (bench-compute's reference)", 256, 256, 256),
    ("cnn conv2 forward, two samples", 128, 64, 800),
    ("cnn conv2 weight gradient, two samples", 800, 64, 128),
    ("cnn conv2 column gradient, two samples", 128, 800, 64),
    ("linear input gradient 1024->1024, batch 64", 64, 1024, 1024),
]


def rate(m, n, k):
    a, b, c = torch.rand(m, k), torch.rand(k, n), torch.empty(m, n)
    for _ in range(50):
        torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(200):
            torch.mm(a, b, out=c)
        best = min(best, (time.perf_counter() - start) / 200)
    return best, 2 * m * n * k / best / 1e9


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for label, m, n, k in SHAPES:
        seconds, gflops = rate(m, n, k)
        print(f"{label:40} {seconds * 1e6:8.1f} us {gflops:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
