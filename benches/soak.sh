#!/bin/sh
# Issue 14.6, the soak: a ring of local nodes trains mlp while non-master nodes are killed, and
# the run survives — prints the wall time, the time lost to the failures (work redone plus
# downtime, from summary.json) and the fraction of wall time that was useful training.
#
#   MODE=restart benches/soak.sh   # 4 nodes; a random non-master node killed every minute, ten
#                                  # times (each attempt's victim 60 s after its links are up);
#                                  # restarts from checkpoints (--max-restarts 10)
#   MODE=replicas benches/soak.sh  # 4 nodes with --stage-replicas: a node killed at 1 and at 2
#                                  # minutes (a ring of 4 can lose two), healed in place
#
# SEED (1), EPOCHS (100), OUT (runs/soak-$MODE) and RINGTMP (the binary; default the one just
# built — point it at a copy if you rebuild while the soak runs) come from the environment.
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
MODE=${MODE:-restart}
SEED=${SEED:-1}
EPOCHS=${EPOCHS:-100}
OUT=${OUT:-runs/soak-$MODE}
RINGTMP=${RINGTMP:-target/release/ringtmp}
case $MODE in
    restart)
        plan=$(awk -v seed="$SEED" 'BEGIN { srand(seed); for (i = 0; i < 10; i++) printf "%s%d:60000", (i ? "," : ""), 1 + int(rand() * 3) }')
        survive="--max-restarts 10"
        ;;
    replicas)
        plan=$(awk -v seed="$SEED" 'BEGIN { srand(seed); a = 1 + int(rand() * 3); b = a; while (b == a) b = 1 + int(rand() * 3); printf "%d:60000+%d:120000", a, b }')
        survive="--stage-replicas 20"
        ;;
    *) echo "MODE is restart or replicas" >&2; exit 2 ;;
esac
echo "kills (rank:ms after the links are up; ',' separates attempts, '+' kills in one): $plan"
start=$(date +%s.%N)
# shellcheck disable=SC2086 # $survive holds two words on purpose
"$RINGTMP" train --strategy ring --nodes 4 --model mlp --epochs "$EPOCHS" \
    --eval-every 0 $survive --crash-plan "$plan" --out "$OUT" --overwrite 2>&1 \
    | grep -E "launcher|final test|restart|ring: rank" | tee "$OUT.log"
end=$(date +%s.%N)
awk -v s="$start" -v e="$end" -v summary="$OUT/summary.json" 'BEGIN {
    wall = e - s
    lost = 0
    while ((getline line < summary) > 0) {
        if (line ~ /"(work_lost|downtime)_seconds"/) { sub(/.*: */, "", line); sub(/,.*/, "", line); lost += line }
    }
    printf "wall %.1f s, lost to failures %.1f s (work redone and downtime), useful %.1f%%\n", wall, lost, 100 * (1 - lost / wall)
}'
