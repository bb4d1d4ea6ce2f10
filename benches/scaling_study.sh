#!/bin/sh
# The scaling study (issue 15.4), made with the simulator: mlp-deep and the 107 M-parameter
# mlp-100m (examples/models/mlp-100m.toml) on 8 to NODES_MAX edge nodes with 100 Mbit/s cards
# and 2 ms latency — one ring, then rings of rings (8 nodes a ring for mlp-deep, 4 for mlp-100m;
# their stages' copies averaging gradients every step, or gossiping their parameters), a
# sharded parameter server (one server per 8 nodes), ring all-reduce and AD-PSGD. Each model's
# cost model is measured once on this machine (run it idle) and shared by every run; to use
# another, put it at <out>/<model>/cost-model.json first. Writes
# docs/reports/scaling-100mbit/<model>/ (compare's report: samples/s against nodes, bytes per
# sample, compute and idle; results.jsonl; every run's summary.json and simulation.json).
#
#   benches/scaling_study.sh                       # both models, 8 … 1024 nodes
#   MODELS=mlp-deep NODES=8,16,32 benches/scaling_study.sh
#
# A rerun keeps the runs that finished (compare's rule).
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-docs/reports/scaling-100mbit}
NODES=${NODES:-8,16,32,64,128,256,512,1024}
LINKS="--bandwidth-mbit 100 --latency-ms 2"
for model in ${MODELS:-mlp-deep mlp-100m}; do
    case $model in
        # Rings of 8 nodes for mlp-deep (17 layers to place), of 4 for mlp-100m (7 layers to
        # place; 27 M parameters, 107 MB, a node).
        mlp-deep) what="--model mlp-deep"; ring=8 ;;
        mlp-100m) what="--model-file examples/models/mlp-100m.toml"; ring=4 ;;
        *) echo "unknown model $model" >&2; exit 2 ;;
    esac
    # Per-node batch 16, so that 1,024 data-parallel workers (a global batch of 16,384) still
    # fit MNIST's 60,000 examples; 3 global batches of the largest sweep in every run. A
    # receive may wait long at 100 Mbit/s with 1,024 nodes: a day of virtual time, not 300 s.
    # shellcheck disable=SC2086 # the option lists are meant to split
    "$RINGTMP" compare --simulate \
        --strategies "ring+ring-nodes=$ring,ring+ring-nodes=$ring+replica-sync=adpsgd,ps:bsp+server-every=8,allreduce,adpsgd" \
        --nodes "$NODES" $what $LINKS --batch-size 16 --train-samples 49152 \
        --recv-timeout 86400 \
        --out "$OUT/$model"
done
