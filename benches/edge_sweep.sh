#!/bin/sh
# Claim (b) of the edge report, scalability: the ring and the parameter server on 2, 4 and 8
# local nodes with 100 Mbit/s emulated cards and 2 ms latency, every node under the same CPU
# quota at every count (compare's sweep share: the machine's cores over the largest count, a
# quarter of a core on 2 cores), at equal training time. Writes docs/reports/edge-sweep/<model>/
# (report.md, report.html, plots/, results.jsonl; runs/ is git-ignored). About 20 minutes a model
# on 2 cores; needs a writable cgroup cpu controller. Then the simulated sweep beyond 8 nodes
# (docs/reports/edge-sweep-simulated/<model>/; SIMULATE=0 skips it).
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
    # Beyond this machine: the same nodes (a quarter of a core, 100 Mbit/s) simulated from 8 to
    # SIM_NODES, with each strategy's scalable form beside it — rings of rings of 2 nodes that
    # average gradients, and a parameter server sharded one server per 4 nodes. Seconds a model.
    if [ "${SIMULATE:-1}" = 1 ]; then
        text=""
        [ "$model" = gpt-cpu ] && text="--dataset text"
        # shellcheck disable=SC2086
        "$RINGTMP" compare --simulate \
            --strategies ring,ring+ring-nodes=2,ps:bsp,ps:bsp+server-every=4 \
            --nodes "${SIM_NODES:-8,16,32,64}" --bandwidth-mbit 100 --latency-ms 2 \
            --node-cpu all:0.25 --model "$model" $text --train-samples 16384 --eval-every 0 \
            --out "${SIM_OUT:-docs/reports/edge-sweep-simulated}/$model"
    fi
done
