#!/bin/sh
# Issue 16.2's measurement: two ring nodes pinned one to a core (`--nodes 2 --pin --threads 1`)
# against the same model trained by `local` on one pinned core (`taskset -c 0`), one epoch, no
# evaluations, alternating so that a slow minute of a shared machine slows both sides alike.
# Needs 2 free cores and python3. Prints, per round, both throughputs, their ratio, each node's
# layers, compute and non-compute seconds (`idle` in summary.json: waiting plus the work of sending
# and receiving) and CPU seconds, and at the end the medians. With CANDIDATE set to a second ringtmp
# binary, each round also runs the ring with it (an A/B of a change, local from the first).
# Each ring node's forward and backward seconds stand beside those of the same layers in local
# (a layer the planner cut inside, `cuts_inside` in the ring's job.json, is in both nodes' ranges:
# its whole local time stands beside each).
# Each run also prints the steal time of the machine's cores during it (`/proc/stat`: time the
# hypervisor gave a core to someone else; a run with steal was not measured on whole cores), and
# each ring node the steal on its own core (`steal_seconds`). First, `ringtmp bench-cores` on
# CPUs 0,1 says what the two cores cost each other computing at once: the ceiling of any ring of
# two on them, and whether they are whole cores (SKIP_CORES=1 leaves it out).
#
#   benches/pair.sh                     # 3 rounds, mlp-deep
#   ROUNDS=7 MODEL=mlp benches/pair.sh
#   MODEL=gpt-small TRAIN_ARGS="--dataset text --max-steps 20" benches/pair.sh   # a language model
#   CANDIDATE=/tmp/other/target/release/ringtmp benches/pair.sh
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli --quiet
RINGTMP=${RINGTMP:-$PWD/target/release/ringtmp}
ROUNDS=${ROUNDS:-3}
MODEL=${MODEL:-mlp-deep}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# How long each run trains (one epoch of the image data; a language model's run needs steps).
common="--model $MODEL ${TRAIN_ARGS:---epochs 1} --eval-every 0 --threads 1"
lscpu | grep 'Model name' || true
if [ -z "${SKIP_CORES:-}" ]; then
    "$RINGTMP" bench-cores --cpus 0,1
fi
# The steal column (the 8th value) of /proc/stat's `cpu` line, in clock ticks.
steal() { awk '$1 == "cpu" { print $9 }' /proc/stat; }
# Runs "$@" with its output in $WORK/$1's run directory, and the steal during it beside it.
run() {
    out=$1
    shift
    before=$(steal)
    "$@" --out "$WORK/$out" >/dev/null 2>&1
    echo "$(( $(steal) - before ))" >"$WORK/$out.steal"
}
round=1
while [ "$round" -le "$ROUNDS" ]; do
    run "$round-ring" "$RINGTMP" train --strategy ring --nodes 2 --pin $common
    if [ -n "${CANDIDATE:-}" ]; then
        run "$round-candidate" "$CANDIDATE" train --strategy ring --nodes 2 --pin $common
    fi
    run "$round-local" taskset -c 0 "$RINGTMP" train --strategy local $common
    round=$((round + 1))
done
python3 - "$WORK" "$ROUNDS" <<'EOF'
import json, os, statistics, sys

work, rounds = sys.argv[1], int(sys.argv[2])
tick = os.sysconf("SC_CLK_TCK")
steal = lambda r, k: int(open(f"{work}/{r}-{k}.steal").read()) / tick
kinds = [k for k in ("ring", "candidate") if os.path.exists(f"{work}/1-{k}")]
ratios = {k: [] for k in kinds}
rates = {k: [] for k in kinds + ["local"]}
for r in range(1, rounds + 1):
    load = lambda k: json.load(open(f"{work}/{r}-{k}/summary.json"))
    local = load("local")
    rates["local"].append(local["samples_per_second"])
    print(f"round {r}: local {local['samples_per_second']:.0f} samples/s, "
          f"compute {local['per_node'][0]['compute_seconds']:.2f} s, "
          f"steal {steal(r, 'local'):.2f} s")
    for k in kinds:
        run = load(k)
        ratio = run["samples_per_second"] / local["samples_per_second"]
        ratios[k].append(ratio)
        rates[k].append(run["samples_per_second"])
        # Forward and backward seconds of a node's layers, and of the same layers in local.
        def passes(summary_node, lo, hi):
            times = [t for t in summary_node.get("layer_seconds", []) if lo <= t[0] < hi]
            return sum(t[1] for t in times), sum(t[2] for t in times)
        def split(n):
            lo, hi = n["layers"]
            (f, b), (lf, lb) = passes(n, lo, hi), passes(local["per_node"][0], lo, hi)
            return f"forward {f:.2f} s (local {lf:.2f}), backward {b:.2f} s (local {lb:.2f}), "
        nodes = "; ".join(
            f"node {n['rank']} layers {n['layers'][0]}..{n['layers'][1]} compute "
            f"{n['compute_seconds']:.2f} s: {split(n)}non-compute "
            f"{n['idle_seconds']:.2f} s (waits: activation "
            f"{n.get('wait_activation_seconds', 0):.2f} s, gradient "
            f"{n.get('wait_gradient_seconds', 0):.2f} s), CPU {n['cpu_seconds']:.2f} s, "
            f"steal on its core {n.get('steal_seconds') or 0:.2f} s"
            for n in run["per_node"])
        print(f"  {k:9} {run['samples_per_second']:.0f} samples/s, {ratio:.2f}x local, "
              f"accuracy {run['final_test_accuracy']:.4f}, steal {steal(r, k):.2f} s ({nodes})")
print("medians: local %.0f samples/s" % statistics.median(rates["local"]))
for k in kinds:
    print(f"  {k:9} {statistics.median(rates[k]):.0f} samples/s, "
          f"{statistics.median(ratios[k]):.2f}x local")
EOF
