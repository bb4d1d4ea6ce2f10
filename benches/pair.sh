#!/bin/sh
# Issue 16.2's measurement: two ring nodes pinned one to a core (`--nodes 2 --pin --threads 1`)
# against the same model trained by `local` on one pinned core (`taskset -c 0`), one epoch, no
# evaluations, alternating so that a slow minute of a shared machine slows both sides alike.
# Needs 2 free cores and python3. Prints, per round, both throughputs, their ratio, each node's
# layers, compute and non-compute seconds (`idle` in summary.json: waiting plus the work of sending
# and receiving) and CPU seconds, and at the end the medians. With CANDIDATE set to a second ringtmp
# binary, each round also runs the ring with it (an A/B of a change, local from the first).
#
#   benches/pair.sh                     # 3 rounds, mlp-deep
#   ROUNDS=7 MODEL=mlp benches/pair.sh
#   CANDIDATE=/tmp/other/target/release/ringtmp benches/pair.sh
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli --quiet
RINGTMP=${RINGTMP:-$PWD/target/release/ringtmp}
ROUNDS=${ROUNDS:-3}
MODEL=${MODEL:-mlp-deep}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
common="--model $MODEL --epochs 1 --eval-every 0 --threads 1"
lscpu | grep 'Model name' || true
round=1
while [ "$round" -le "$ROUNDS" ]; do
    "$RINGTMP" train --strategy ring --nodes 2 --pin $common --out "$WORK/$round-ring" >/dev/null 2>&1
    if [ -n "${CANDIDATE:-}" ]; then
        "$CANDIDATE" train --strategy ring --nodes 2 --pin $common --out "$WORK/$round-candidate" \
            >/dev/null 2>&1
    fi
    taskset -c 0 "$RINGTMP" train --strategy local $common --out "$WORK/$round-local" >/dev/null 2>&1
    round=$((round + 1))
done
python3 - "$WORK" "$ROUNDS" <<'EOF'
import json, os, statistics, sys

work, rounds = sys.argv[1], int(sys.argv[2])
kinds = [k for k in ("ring", "candidate") if os.path.exists(f"{work}/1-{k}")]
ratios = {k: [] for k in kinds}
rates = {k: [] for k in kinds + ["local"]}
for r in range(1, rounds + 1):
    load = lambda k: json.load(open(f"{work}/{r}-{k}/summary.json"))
    local = load("local")
    rates["local"].append(local["samples_per_second"])
    print(f"round {r}: local {local['samples_per_second']:.0f} samples/s, "
          f"compute {local['per_node'][0]['compute_seconds']:.2f} s")
    for k in kinds:
        run = load(k)
        ratio = run["samples_per_second"] / local["samples_per_second"]
        ratios[k].append(ratio)
        rates[k].append(run["samples_per_second"])
        nodes = "; ".join(
            f"node {n['rank']} layers {n['layers'][0]}..{n['layers'][1]} compute "
            f"{n['compute_seconds']:.2f} s, non-compute "
            f"{n['idle_seconds']:.2f} s (waits: activation "
            f"{n.get('wait_activation_seconds', 0):.2f} s, gradient "
            f"{n.get('wait_gradient_seconds', 0):.2f} s), CPU {n['cpu_seconds']:.2f} s"
            for n in run["per_node"])
        print(f"  {k:9} {run['samples_per_second']:.0f} samples/s, {ratio:.2f}x local, "
              f"accuracy {run['final_test_accuracy']:.4f} ({nodes})")
print("medians: local %.0f samples/s" % statistics.median(rates["local"]))
for k in kinds:
    print(f"  {k:9} {statistics.median(rates[k]):.0f} samples/s, "
          f"{statistics.median(ratios[k]):.2f}x local")
EOF
