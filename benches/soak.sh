#!/bin/sh
# Issue 14.6, the soak: a ring of 4 local nodes trains mlp while a random non-master node is
# killed every minute, ten times (each attempt's victim dies 60 s after its links are up), with
# automatic restarts from checkpoints. Prints the wall time, the time the restarts lost (work
# redone plus downtime, from summary.json) and the fraction of wall time that was useful.
#
#   benches/soak.sh                    # SEED=1 EPOCHS=100 OUT=runs/soak
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
SEED=${SEED:-1}
EPOCHS=${EPOCHS:-100}
OUT=${OUT:-runs/soak}
plan=$(awk -v seed="$SEED" 'BEGIN { srand(seed); for (i = 0; i < 10; i++) printf "%s%d:60000", (i ? "," : ""), 1 + int(rand() * 3) }')
echo "kills (rank:ms after the links are up, one per attempt): $plan"
start=$(date +%s.%N)
target/release/ringtmp train --strategy ring --nodes 4 --model mlp --epochs "$EPOCHS" \
    --eval-every 0 --max-restarts 10 --crash-plan "$plan" --out "$OUT" --overwrite \
    2>&1 | grep -E "launcher|final test|restart" | tee "$OUT.log"
end=$(date +%s.%N)
lost=$(sed -n 's/.*restart(s); \([0-9.]*\)s lost.*/\1/p' "$OUT.log")
awk -v s="$start" -v e="$end" -v lost="${lost:-0}" 'BEGIN {
    wall = e - s
    printf "wall %.1f s, lost to restarts %.1f s, useful %.1f%%\n", wall, lost, 100 * (1 - lost / wall)
}'
