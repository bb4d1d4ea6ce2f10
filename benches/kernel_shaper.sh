#!/usr/bin/env bash
# ringtmp's emulated network cards against the kernel's own shaper (issue 13.1). Needs root (it
# creates network namespaces). Each of 4 nodes runs in its own namespace on a bridge, its
# interface limited by tbf at RATE_MBIT; then the same job runs on loopback with
# `ringtmp train --bandwidth-mbit RATE_MBIT`. Prints samples/s of both, per strategy.
# Usage: sudo benches/kernel_shaper.sh [OUT_DIR]   (from the repository root, after a release build)
set -euo pipefail
rate=${RATE_MBIT:-100}
steps=${STEPS:-20}
n=4
bin=$(realpath "${RINGTMP:-target/release/ringtmp}")
out=${1:-/tmp/ringtmp-kernel-shaper}
cleanup() {
  for r in $(seq 0 $((n - 1))); do ip netns del "rt$r" 2>/dev/null || true; done
  ip link del rtbr0 2>/dev/null || true
}
trap cleanup EXIT
cleanup
rm -rf "$out" && mkdir -p "$out"
ip link add rtbr0 type bridge
ip link set rtbr0 up
for r in $(seq 0 $((n - 1))); do
  ip netns add "rt$r"
  ip link add "rtv$r" type veth peer name eth0 netns "rt$r"
  ip link set "rtv$r" master rtbr0 up
  ip -n "rt$r" addr add "10.77.0.$((r + 1))/24" dev eth0
  ip -n "rt$r" link set eth0 up
  ip -n "rt$r" link set lo up
  # The node's card: everything it sends leaves at RATE_MBIT.
  ip netns exec "rt$r" tc qdisc add dev eth0 root tbf rate "${rate}mbit" burst 64kb latency 1s
done
samples() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['samples_per_second']))" "$1"; }
for strategy in ps ring; do
  extra=""
  [[ $strategy == ps ]] && extra='servers = 1'
  cfg="$out/$strategy.toml"
  cat > "$cfg" <<TOML
strategy = "$strategy"
nodes = $n
$extra
model = "mlp"
max-steps = $steps
eval-every = 0
out = "$out/kernel-$strategy"
TOML
  pids=()
  for r in $(seq 0 $((n - 1))); do
    ip netns exec "rt$r" env RINGTMP_SECRET=kernel-shaper-bench "$bin" node --rank "$r" \
      --world-size $n --master-addr 10.77.0.1 --master-port 29555 --listen "10.77.0.$((r + 1))" \
      --job train --config "$cfg" >"$out/kernel-$strategy-$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  ex=()
  [[ $strategy == ps ]] && ex=(--servers 1)
  "$bin" train --strategy "$strategy" --nodes $n "${ex[@]}" --model mlp --max-steps "$steps" \
    --eval-every 0 --bandwidth-mbit "$rate" --out "$out/emulated-$strategy" >/dev/null 2>&1
  echo "$strategy at $rate Mbit/s: kernel $(samples "$out/kernel-$strategy/summary.json") samples/s," \
    "emulated $(samples "$out/emulated-$strategy/summary.json") samples/s"
done
