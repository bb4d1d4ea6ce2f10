#!/bin/sh
# Issue 16.2's scaling curve under CPU quotas: rings of 2, 3, 4 … nodes of CORES core each
# (`--node-cpu`, a kernel CFS quota per node process) against `local` under the same quota
# (`--node-cpu 0:CORES`), mlp-deep, SAMPLES training samples, no evaluations. Each node's compute, CPU and
# throttled seconds (how long its quota held it off the CPU) come with each run: under a quota a
# node's compute wall time includes its throttled periods, so the busiest node is the one whose
# throttled time is largest, whatever its compute reads.
#
# Needs root or a delegated cgroup with the cpu controller, as `--node-cpu` does.
#
#   benches/quota_curve.sh                       # 2 rounds of 2, 3, 4 nodes of half a core
#   ROUNDS=1 NODES="2 4" CORES=0.25 benches/quota_curve.sh
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli --quiet
RINGTMP=${RINGTMP:-$PWD/target/release/ringtmp}
ROUNDS=${ROUNDS:-2}
NODES=${NODES:-2 3 4}
CORES=${CORES:-0.5}
SAMPLES=${SAMPLES:-30000}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
common="--model mlp-deep --threads 1 --train-samples $SAMPLES --eval-every 0"
lscpu | grep 'Model name' || true
report() {
    python3 - "$1" "$2" "${3:-}" <<'EOF'
import json, sys
run, label, local = sys.argv[1], sys.argv[2], sys.argv[3]
s = json.load(open(f"{run}/summary.json"))
rate = s["samples_per_second"]
ratio = ""
if local:
    base = json.load(open(f"{local}/summary.json"))["samples_per_second"]
    nodes = len(s["per_node"])
    ratio = f", {rate / base:.2f}x local ({rate / base / nodes:.0%} a node)"
nodes = "; ".join(
    f"node {n['rank']} compute {n['compute_seconds']:.1f} s, CPU {n['cpu_seconds']:.1f} s, "
    f"throttled {n.get('throttled_seconds') or 0:.1f} s"
    for n in s["per_node"])
print(f"  {label:8} {rate:.0f} samples/s{ratio} ({nodes})")
EOF
}
round=1
while [ "$round" -le "$ROUNDS" ]; do
    echo "round $round ($CORES core a node):"
    "$RINGTMP" train --strategy local --node-cpu "0:$CORES" $common --out "$WORK/$round-local" \
        >/dev/null 2>&1
    report "$WORK/$round-local" local
    for n in $NODES; do
        cpu=$(python3 -c "print(','.join(f'{r}:$CORES' for r in range($n)))")
        "$RINGTMP" train --strategy ring --nodes "$n" --node-cpu "$cpu" $common \
            --out "$WORK/$round-ring-$n" >/dev/null 2>&1
        report "$WORK/$round-ring-$n" "ring $n" "$WORK/$round-local"
    done
    round=$((round + 1))
done
