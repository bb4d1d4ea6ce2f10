#!/bin/sh
# The failure half of the scaling study (issue 15.4), made with the simulator: mlp-deep on 8 to
# NODES_MAX edge nodes (100 Mbit/s cards, 2 ms latency) when every node fails RATE times per hour
# (default 0.01: one failure per 100 node-hours), over a 24-hour training, each strategy with its
# own recovery. Every run injects one failure into its strategy's protocol (the highest rank the
# strategy can lose) to measure the recovery, then follows the 24 hours through failures of every
# node (`ringtmp simulate --failures-per-node-hour`). Strategies: rings of rings of 8 nodes, their
# stages averaging gradients every step or parameters every 32 mini-batches (any failure restarts
# from a checkpoint), the sharded parameter server under BSP (restarts) and ASP
# (drops a dead worker), ring all-reduce (re-forms its ring without the dead worker) and AD-PSGD
# (goes on without it). Writes docs/reports/scaling-100mbit-failures/mlp-deep/.
#
#   benches/failure_study.sh
#   RATE=0.1 NODES=8,16,32 OUT=/tmp/f benches/failure_study.sh
#
# A rerun keeps the runs that finished (compare's rule).
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-docs/reports/scaling-100mbit-failures}
NODES=${NODES:-8,16,32,64,128,256}
RATE=${RATE:-0.01}
# shellcheck disable=SC2086 # the option lists are meant to split
"$RINGTMP" compare --simulate \
    --strategies "ring+ring-nodes=8,ring+ring-nodes=8+replica-sync=every:32,ps:bsp+server-every=8,ps:asp+server-every=8,allreduce,adpsgd" \
    --nodes "$NODES" --model mlp-deep --bandwidth-mbit 100 --latency-ms 2 \
    --batch-size 16 --train-samples 49152 --recv-timeout 86400 \
    --failures-per-node-hour "$RATE" --horizon-hours 24 --restart-seconds 60 --disk-mbyte-s 50 \
    --out "$OUT/mlp-deep"
