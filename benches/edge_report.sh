#!/bin/sh
# The published edge-profile report (issue 13.7): every strategy on 4 local nodes, each with a
# 100 Mbit/s emulated card, 2 ms one-way latency and half a core (a kernel CPU quota), for the
# mlp, mlp-deep and cnn presets and the gpt-cpu language model on the bundled Shakespeare, at
# equal training time per model (`compare --train-seconds`:
# each strategy's sample budget is that time × its own samples/s, measured by a probe run, so a
# fast strategy is not cut short by a budget a slow one needs). Writes
# docs/reports/edge-4x100mbit/<model>/ (report.md, report.html, plots/ and results.jsonl, which
# are published, and every run's directory under runs/, which git ignores). About 100 minutes on
# 2 cores; needs a writable cgroup cpu controller (run as root, or where cgroups are delegated).
#
#   benches/edge_report.sh                 # all four models
#   MODELS=cnn benches/edge_report.sh      # one of them
#
# A rerun skips the runs that already finished (compare's own rule); delete a model's directory
# to measure it again.
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-docs/reports/edge-4x100mbit}
PROFILE="--nodes 4 --bandwidth-mbit 100 --latency-ms 2 --node-cpu 0:0.5,1:0.5,2:0.5,3:0.5"
# Two rings of two nodes synchronised like DiLoCo every 100 mini-batches, and DiLoCo's workers
# with H = 100 (issue 45): the fifth claim's rows.
RINGS=ring+ring-nodes=2+replica-sync=diloco:100
STRATEGIES=ring,ring:1f1b,$RINGS,ps:bsp,ps:bsp+servers=2,ps:dssp:1:4,allreduce,dpsgd,adpsgd,diloco:100
for model in ${MODELS:-mlp mlp-deep cnn gpt-cpu}; do
    strategies=$STRATEGIES
    case $model in
        mlp) length="--train-seconds 120 --target-accuracy 0.95 --eval-every 50" ;;
        mlp-deep) length="--train-seconds 120 --target-accuracy 0.90 --eval-every 50" ;;
        # The cnn's activations are large (100 KB a sample after its first convolution): one
        # evaluation pass of the 10,000 test images around the ring takes 80 s at 100 Mbit/s,
        # so the cnn is evaluated once, at the end.
        cnn) length="--train-seconds 180 --target-accuracy 0.97 --eval-every 0" ;;
        # The language model: validation loss on 64 fixed windows (4,096 tokens) every 100
        # steps. Its recipe clips gradients, so the ring runs 1F1B (async is refused with
        # clipping): `ring` alone stands for it.
        gpt-cpu)
            length="--dataset text --train-seconds 150 --eval-every 100 --eval-tokens 4096"
            strategies=ring,$RINGS+schedule=1f1b,ps:bsp,ps:bsp+servers=2,ps:dssp:1:4,allreduce
            strategies=$strategies,dpsgd,adpsgd,diloco:100
            ;;
        *) echo "unknown model $model" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086 # the option lists are meant to split
    "$RINGTMP" compare --strategies $strategies $PROFILE --model "$model" $length \
        --out "$OUT/$model"
done
