#!/bin/sh
# DiLoCo over slow links (issue 45.6): the strategy families on 4 local nodes with emulated
# cards of 100 and 10 Mbit/s, 2 ms one-way latency and half a core each (a kernel CPU quota),
# at equal training time, for the mlp and the gpt-cpu language model on the bundled Shakespeare:
# one ring, two rings of two synchronised like DiLoCo (--replica-sync diloco:100), the
# parameter server, all-reduce, AD-PSGD and DiLoCo with H = 100. At 10 Mbit/s the parameter
# server is left out (5 samples/s on the mlp: its probe alone takes 7 minutes) and the language
# model runs the rings, all-reduce and DiLoCo for 60 s. Then the language model at equal tokens
# (all-reduce against DiLoCo, the same 28,800 windows each, at 100 Mbit/s). Writes
# docs/reports/diloco-4x<MBIT>mbit/<model>/ and docs/reports/diloco-equal-tokens/gpt-cpu/
# (report.md, report.html, plots/, results.jsonl; runs/ is git-ignored). About 75 minutes on
# 2 cores; needs a writable cgroup cpu controller. The simulated clusters of 64 and 1,024 nodes
# are benches/diloco_simulated.sh.
#
#   benches/diloco_report.sh
#   MBITS=10 MODELS=mlp benches/diloco_report.sh
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
PROFILE="--nodes 4 --latency-ms 2 --node-cpu 0:0.5,1:0.5,2:0.5,3:0.5"
RINGS=ring+ring-nodes=2+replica-sync=diloco:100
for mbit in ${MBITS:-100 10}; do
    for model in ${MODELS:-mlp gpt-cpu}; do
        case $mbit/$model in
            100/mlp)
                length="--train-seconds 60 --target-accuracy 0.95 --eval-every 50"
                strategies=ring,$RINGS,ps:bsp,allreduce,adpsgd,diloco:100
                ;;
            10/mlp)
                length="--train-seconds 60 --target-accuracy 0.95 --eval-every 50"
                strategies=ring,$RINGS,allreduce,adpsgd,diloco:100
                ;;
            # Its recipe clips gradients: rings run 1F1B (async is refused with clipping).
            100/gpt-cpu)
                length="--dataset text --train-seconds 90 --eval-every 100 --eval-tokens 4096"
                strategies=ring,$RINGS+schedule=1f1b,ps:bsp,allreduce,adpsgd,diloco:100
                ;;
            10/gpt-cpu)
                length="--dataset text --train-seconds 60 --eval-every 100 --eval-tokens 4096"
                strategies=$RINGS+schedule=1f1b,allreduce,diloco:100
                ;;
            *) echo "no plan for $model at $mbit Mbit/s" >&2; exit 2 ;;
        esac
        # shellcheck disable=SC2086 # the option lists are meant to split
        "$RINGTMP" compare --strategies "$strategies" $PROFILE --bandwidth-mbit "$mbit" \
            --model "$model" $length --out "docs/reports/diloco-4x${mbit}mbit/$model"
    done
done
if [ "${EQUAL_TOKENS:-1}" = 1 ]; then
    # shellcheck disable=SC2086
    "$RINGTMP" compare --strategies allreduce,diloco:100 $PROFILE --bandwidth-mbit 100 \
        --model gpt-cpu --dataset text --train-samples 28800 --eval-every 100 \
        --eval-tokens 4096 --out docs/reports/diloco-equal-tokens/gpt-cpu
fi
