#!/usr/bin/env bash
# A mixed-architecture cluster on one machine (issue 17.3): an x86-64 master (pinned to core 0)
# and two aarch64 nodes run by qemu-user (pinned together to core 1: emulated, each on half a
# core, they stand in for weak boards), started by hand with an external launcher's variables.
# Runs the ring planned from every node's own profile (the default under an external launcher)
# and from rank 0's profile alone (--no-node-profile), then the parameter server with the two
# boards as workers beside an x86-64 worker and server; prints samples/s, accuracy, each node's
# layers, compute and idle, and the profile lines of each plan.
#
# Needs the aarch64 toolchain .ci/run installs (Debian's gcc-aarch64-linux-gnu,
# libc6-dev-arm64-cross, qemu-user-static; rustup's aarch64-unknown-linux-gnu target).
# Usage: benches/mixed_ring.sh [OUT_DIR] [STEPS]   (from the repository root)
# STEPS (default 30) bounds the runs whose every step waits for an emulated node's whole share;
# the ring planned from the nodes' own profiles runs 20× as many (it is that much faster).
set -euo pipefail
out=${1:-/tmp/ringtmp-mixed}
steps=${2:-30}
target=aarch64-unknown-linux-gnu
cargo build --release -p ringtmp-cli --quiet
cargo build --release -p ringtmp-cli --target "$target" --quiet
x86=$PWD/target/release/ringtmp
arm=$PWD/target/$target/release/ringtmp
qemu=(qemu-aarch64-static -L /usr/aarch64-linux-gnu)
rm -rf "$out" && mkdir -p "$out"
export RINGTMP_SECRET=mixed-ring-bench-secret-0123456789

# run NAME STEPS X86 STRATEGY_LINES RANK0_FLAGS...: one run of X86 x86-64 nodes (rank 0 first,
# on core 0) and two aarch64 nodes after them (on core 1); waits for all of them.
run() {
  local name=$1 steps=$2 x86_nodes=$3 strategy=$4
  shift 4
  local dir=$out/$name port world=$((x86_nodes + 2)) pids=()
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  mkdir -p "$dir"
  printf '%b' "$strategy\ndataset = \"mnist\"\nmodel = \"mlp\"\nmax-steps = $steps\neval-every = 0\nout = \"$dir/run\"\n" >"$dir/train.toml"
  local common=(node --job train --connect-timeout 120 --recv-timeout 600)
  export RINGTMP_CACHE_DIR=$dir/cache WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
  for ((rank = 1; rank < world; rank++)); do
    if ((rank < x86_nodes)); then
      RANK=$rank "$x86" "${common[@]}" --cpu 0 >"$dir/rank$rank.log" 2>&1 &
    else
      RANK=$rank "${qemu[@]}" "$arm" "${common[@]}" --cpu 1 >"$dir/rank$rank.log" 2>&1 &
    fi
    pids+=($!)
  done
  RANK=0 "$x86" "${common[@]}" --cpu 0 --config "$dir/train.toml" "$@" >"$dir/rank0.out" 2>"$dir/rank0.log"
  wait "${pids[@]}"
  python3 - "$dir/run/summary.json" "$name" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:20} {s['samples_per_second']:8.1f} samples/s  {s['steps']} steps  "
      f"train {s['train_seconds']:.1f} s  test accuracy {100 * s['final_test_accuracy']:.2f}%")
for n in s["per_node"]:
    layers = n.get("layers")
    work = f"layers {layers}" if layers else f"iterations {n.get('iterations')}"
    print(f"    rank {n['rank']} {n['role']:7} params {n['params']:>8}  {work}  "
          f"compute {n['compute_seconds']:7.1f} s  idle {n['idle_seconds']:7.1f} s")
PY
  grep -E "^  node [0-9]+:|own profiles|the plan uses" "$dir/rank0.log" | sed 's/^/    | /' || true
}

# The ring: an x86-64 master and two boards, planned from every node's own profile, then from
# rank 0's alone.
run ring-own-profiles $((steps * 20)) 1 'strategy = "ring"'
run ring-rank0-profile "$steps" 1 'strategy = "ring"' --no-node-profile
# The parameter server: an x86-64 server, an x86-64 worker and the two boards as workers.
run ps-bsp "$steps" 2 'strategy = "ps"\nconsistency = "bsp"'
run ps-dssp $((steps * 4)) 2 'strategy = "ps"\nconsistency = "dssp:1:4"'
