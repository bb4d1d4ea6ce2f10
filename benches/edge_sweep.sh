#!/bin/sh
# Claim (b) of the edge report, scalability: the ring and the parameter server on 2, 4 and 8
# local nodes with 100 Mbit/s emulated cards and 2 ms latency, every node under the same CPU
# quota at every count (compare's sweep share: the machine's cores over the largest count, a
# quarter of a core on 2 cores), at equal training time. Writes docs/reports/edge-sweep/<model>/
# (report.md, report.html, plots/, results.jsonl; runs/ is git-ignored). About 20 minutes a model
# on 2 cores; needs a writable cgroup cpu controller.
#
#   MODELS=gpt-cpu benches/edge_sweep.sh
#   MODELS="mlp cnn" NODES=2,4 benches/edge_sweep.sh
#   MODELS="mlp cnn" TRAIN_SECONDS=60 benches/edge_sweep.sh   # shorter runs: throughput only
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-docs/reports/edge-sweep}
NODES=${NODES:-2,4,8}
for model in ${MODELS:-mlp mlp-deep cnn gpt-cpu}; do
    case $model in
        mlp | mlp-deep) length="--train-seconds ${TRAIN_SECONDS:-120} --target-accuracy 0.90 --eval-every 50" ;;
        cnn) length="--train-seconds ${TRAIN_SECONDS:-180} --target-accuracy 0.97 --eval-every 0" ;;
        gpt-cpu) length="--dataset text --train-seconds ${TRAIN_SECONDS:-120} --eval-every 100 --eval-tokens 4096" ;;
        *) echo "unknown model $model" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086 # the option lists are meant to split
    "$RINGTMP" compare --strategies ring,ps:bsp --nodes "$NODES" --bandwidth-mbit 100 \
        --latency-ms 2 --model "$model" $length --out "$OUT/$model"
done
