#!/usr/bin/env bash
# Compute throughput of ringtmp and the reference frameworks at both x86 SIMD levels, on one
# machine, one after the other (issue 16.3 and 16.4).
#
# On a CPU with AVX-512 this measures the AVX2 machine kind's code paths as well: ringtmp built
# without its `avx512` feature (the GEMM's 8-lane micro-kernels, the element-wise loops' AVX2
# versions) against PyTorch and TensorFlow with oneDNN capped the same way
# (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2). It is the instruction set of the AVX2 kind
# on this machine's cores, caches and memory, not that machine: the ratios it gives are a proxy
# until measured there (on an AVX2-only CPU both rows run the same code).
#
#   benches/isa_compare.sh [ROUNDS] [THREADS]        (defaults: 2 rounds, threads 1,2)
#
# Needs: `pip install torch numpy` for PyTorch; TensorFlow is measured when $TF_PYTHON names a
# Python with `tensorflow-cpu==2.15.*` (benches/reference/tf_throughput.py says how). Prints the
# tools' own lines; docs/benchmarks/logs/log-11.md has the table made from them.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
threads=${2:-1,2}
models=mlp,cnn

cargo build --release -p ringtmp-cli --quiet
cargo build --release -p ringtmp-cli --no-default-features --target-dir target/avx2 --quiet
full=target/release/ringtmp
capped=target/avx2/release/ringtmp

lscpu | grep -E "^Model name" || true
for round in $(seq "$rounds"); do
  echo "== round $round"
  echo "-- ringtmp, widest SIMD level"
  "$full" bench-compute --models "$models" --threads "$threads"
  echo "-- ringtmp, capped at AVX2+FMA"
  "$capped" bench-compute --models "$models" --threads "$threads"
  for t in ${threads//,/ }; do
    echo "-- PyTorch, $t thread(s), widest / AVX2"
    python3 benches/reference/torch_throughput.py --threads "$t" --models "$models"
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
      python3 benches/reference/torch_throughput.py --threads "$t" --models "$models"
    if [ -n "${TF_PYTHON:-}" ]; then
      echo "-- TensorFlow, $t thread(s), widest / AVX2"
      "$TF_PYTHON" benches/reference/tf_throughput.py --threads "$t" --models "$models" 2>/dev/null
      ONEDNN_MAX_CPU_ISA=AVX2 \
        "$TF_PYTHON" benches/reference/tf_throughput.py --threads "$t" --models "$models" 2>/dev/null
    fi
  done
done
