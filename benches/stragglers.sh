#!/usr/bin/env bash
# Samples/s of the data-parallel family with and without a quarter-speed worker (issue 12.4):
# mlp on MNIST, 4 workers x 64, 300 global steps, no evaluation. Prints one line per run.
# Usage: benches/stragglers.sh [OUT_DIR]   (run from the repository root, after a release build)
set -euo pipefail
out=${1:-/tmp/ringtmp-stragglers}
bin=${RINGTMP:-target/release/ringtmp}
rm -rf "$out" && mkdir -p "$out"
for strategy in allreduce dpsgd adpsgd; do
  for speed in none 1:0.25; do
    dir="$out/$strategy-${speed/:/-}"
    extra=()
    [[ $speed != none ]] && extra=(--node-speed "$speed")
    "$bin" train --strategy "$strategy" --nodes 4 --model mlp --max-steps 300 --eval-every 0 \
      --out "$dir" "${extra[@]}" >/dev/null 2>"$dir.log"
    python3 - "$dir/summary.json" "$strategy" "$speed" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
iters = " ".join(str(n["iterations"]) for n in s["per_node"])
print(f"{sys.argv[2]:10} straggler {sys.argv[3]:7} {s['samples_per_second']:8.0f} samples/s  "
      f"iterations per rank: {iters}")
PY
  done
done
