#!/usr/bin/env bash
# The healing soak (issue 40.1): rings of 4 local nodes with --stage-replicas train the mlp on
# MNIST for 2 epochs while, from outside, a seeded non-master node is killed (SIGKILL) or frozen
# (SIGSTOP) at a seeded moment. Each run must heal to the accuracy of the unbroken run of its
# schedule within 0.3 points, or be restarted by --max-restarts; prints a row per run and the
# count.
#
#   benches/heal_soak.sh            # 20 runs, 1f1b and async in turn, plus one unbroken run each
#
# SEED (1), RUNS (20), OUT (runs/heal-soak) and RINGTMP (the binary; default the one just built)
# come from the environment. About 25 s a run on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli --quiet
SEED=${SEED:-1}
RUNS=${RUNS:-20}
OUT=${OUT:-runs/heal-soak}
RINGTMP=${RINGTMP:-target/release/ringtmp}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

train() { # out schedule
    "$RINGTMP" train --strategy ring --nodes 4 --use-all-nodes --model mlp --epochs 2 \
        --schedule "$2" --stage-replicas 20 --max-restarts 1 --out "$1" --overwrite
}
accuracy() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["final_test_accuracy"])' "$1/summary.json"; }

declare -A unbroken
for schedule in 1f1b async; do
    train "$OUT/unbroken-$schedule" "$schedule" > "$OUT/unbroken-$schedule.log" 2>&1
    unbroken[$schedule]=$(accuracy "$OUT/unbroken-$schedule")
    echo "unbroken $schedule: accuracy ${unbroken[$schedule]}"
done

# The seeded plan: per run, the victim (1-3), the signal and the delay after the victim starts.
plan=$(awk -v seed="$SEED" -v runs="$RUNS" 'BEGIN { srand(seed); for (i = 0; i < runs; i++)
    printf "%d %s %.1f\n", 1 + int(rand() * 3), (rand() < 0.5 ? "KILL" : "STOP"), 3 + rand() * 9 }')
printf '%-4s %-6s %-5s %-5s %-7s %-10s %-9s %s\n' run sched rank sig at_s outcome accuracy delta_pts
healed=0 restarted=0 failed=0 i=0
while read -r rank signal delay; do
    i=$((i + 1))
    schedule=$([ $((i % 2)) -eq 1 ] && echo 1f1b || echo async)
    out="$OUT/run-$i"
    train "$out" "$schedule" > "$out.log" 2>&1 &
    launcher=$!
    victim=""
    for _ in $(seq 1 300); do
        victim=$(pgrep -f -- "node --rank $rank .*--config $out/" || true)
        [ -n "$victim" ] && break
        sleep 0.1
    done
    sleep "$delay"
    [ -n "$victim" ] && kill -"$signal" "$victim" 2>/dev/null || true
    status=0
    wait "$launcher" || status=$?
    outcome=failed acc=- delta=-
    if [ "$status" -eq 0 ] && [ -f "$out/summary.json" ]; then
        acc=$(accuracy "$out")
        delta=$(python3 -c "print(f'{100 * ($acc - ${unbroken[$schedule]}):+.2f}')")
        if grep -q "ring: rank $rank left" "$out.log"; then
            outcome=healed
        elif grep -q "launcher: restart" "$out.log"; then
            outcome=restarted
        else
            outcome=unharmed # the run had ended before the signal
        fi
        if python3 -c "import sys; sys.exit(abs($delta) > 0.3)"; then :; else outcome="$outcome(off)"; fi
    fi
    case $outcome in
        healed) healed=$((healed + 1)) ;;
        restarted) restarted=$((restarted + 1)) ;;
        *) failed=$((failed + 1)) ;;
    esac
    printf '%-4s %-6s %-5s %-5s %-7s %-10s %-9s %s\n' "$i" "$schedule" "$rank" "$signal" "$delay" "$outcome" "$acc" "$delta"
done <<< "$plan"
echo "$RUNS runs: $healed healed within 0.3 points, $restarted restarted within 0.3 points, $failed otherwise"
