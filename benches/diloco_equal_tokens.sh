#!/bin/sh
# DiLoCo against all-reduce at equal tokens, from a warm start (issue 45.6): 300 synchronous
# all-reduce steps of 4 workers × 12 windows (exported as model.safetensors), then STEPS more
# steps per arm from that start, every arm on the same windows in the same order, on loopback
# (the losses do not depend on the links; the runs are deterministic). One line per arm in
# $OUT/results.txt: the validation loss (4,096 tokens) every EVAL steps, the last one the end.
#
#   benches/diloco_equal_tokens.sh                                  # gpt-cpu, 1,200 steps
#   STEPS=2400 EVAL=600 benches/diloco_equal_tokens.sh
#   MODEL="--model-file benches/models/gpt-w256.toml --seq-len 64" OUT=/tmp/w256 \
#       benches/diloco_equal_tokens.sh
#   ARMS="diloco-tuned:--strategy diloco --inner-steps 100 --lr 0.0057 --outer-momentum 0.8 \
#       --outer-schedule inner" benches/diloco_equal_tokens.sh
#
# ARMS: arms separated by ';', each NAME:ARGS. About 10 minutes on 2 cores for gpt-cpu's
# default arms (AMD EPYC Zen 4), 30 for width 256.
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
MODEL=${MODEL:---model gpt-cpu}
STEPS=${STEPS:-1200}
EVAL=${EVAL:-300}
OUT=${OUT:-target/diloco-equal-tokens}
ARMS=${ARMS:-"allreduce:--strategy allreduce;diloco:--strategy diloco --inner-steps 100;diloco-inner:--strategy diloco --inner-steps 100 --outer-schedule inner"}
COMMON="--nodes 4 $MODEL --dataset text --eval-tokens 4096"
mkdir -p "$OUT"
if [ ! -f "$OUT/warm/model.safetensors" ]; then
    # shellcheck disable=SC2086
    $RINGTMP train --strategy allreduce $COMMON --train-samples 14400 --eval-every 100 \
        --checkpoint-every 300 --out "$OUT/warm-run" > "$OUT/warm.log" 2>&1
    $RINGTMP export --checkpoint "$OUT/warm-run" "$OUT/warm" >> "$OUT/warm.log" 2>&1
fi
losses() {
    grep '"eval"' "$1/metrics.jsonl" | sed 's/.*"test_loss":\([0-9.]*\).*/\1/' | tr '\n' ' '
}
echo "warm start: $(losses "$OUT/warm-run")" > "$OUT/results.txt"
echo "$ARMS" | tr ';' '\n' | while IFS= read -r arm; do
    [ -n "$arm" ] || continue
    name=${arm%%:*}
    args=${arm#*:}
    # shellcheck disable=SC2086
    $RINGTMP train $COMMON $args --init-from "$OUT/warm/model.safetensors" \
        --train-samples $((STEPS * 48)) --eval-every "$EVAL" --out "$OUT/$name" \
        > "$OUT/$name.log" 2>&1
    echo "$name: $(losses "$OUT/$name")" | tee -a "$OUT/results.txt"
done
