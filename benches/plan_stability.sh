#!/bin/sh
# Issue 16.2 (docs/decisions/planner.md): how steady the partition planner's cut is when the machine
# slows down while it profiles. Plans `mlp-deep` on two nodes PLANS times (each plan trains 640
# samples, a few seconds), the planning process pinned to core 0; with LOAD=1 (the default) a
# load on core 0 runs busy 150 ms of every 300 ms meanwhile. Prints each plan's cut and
# predicted per-node milliseconds, then how often each cut was chosen.
#
#   benches/plan_stability.sh                  # 8 plans under the periodic load
#   LOAD=0 PLANS=12 benches/plan_stability.sh  # without it
#   RINGTMP=/tmp/other/target/release/ringtmp benches/plan_stability.sh   # another build
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli --quiet
RINGTMP=${RINGTMP:-$PWD/target/release/ringtmp}
PLANS=${PLANS:-8}
LOAD=${LOAD:-1}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
lscpu | grep 'Model name' || true
i=1
while [ "$i" -le "$PLANS" ]; do
    if [ "$LOAD" = 1 ]; then
        python3 -c '
import os, time
os.sched_setaffinity(0, {0})
end = time.time() + 8
while time.time() < end:
    busy = time.time() + 0.15
    while time.time() < busy:
        pass
    time.sleep(0.15)
' &
        load=$!
    fi
    taskset -c 0 "$RINGTMP" train --strategy ring --nodes 2 --model mlp-deep --train-samples 640 \
        --eval-every 0 --threads 1 --out "$WORK/run" --overwrite 2>&1 |
        sed -nE 's/.*node ([01]): layers ([0-9.]+) .*predicted ([0-9.]+) ms.*/node \1 \2 \3 ms/p' |
        tr '\n' ' ' | tee -a "$WORK/plans"
    echo | tee -a "$WORK/plans"
    if [ "$LOAD" = 1 ]; then wait "$load"; fi
    i=$((i + 1))
done
echo "cuts chosen:"
sed -E 's/node 0 ([0-9.]+) .*/node 0 holds \1/' "$WORK/plans" | sort | uniq -c
