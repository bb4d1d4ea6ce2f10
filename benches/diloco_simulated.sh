#!/bin/sh
# DiLoCo past this machine (issue 45.6): the data-parallel strategies and rings of 4-node rings
# synchronised like DiLoCo on simulated clusters of 64 and 1,024 nodes (mlp, batch 16 a worker
# or ring, 100 Mbit/s cards, 2 ms latency, a quarter of a core each; compute priced by the cost
# model measured here, tensors as sizes, so accuracy is not simulated). DiLoCo and the rings run
# 200 steps (two synchronisations of H = 100); the others 20 steps (their traffic per sample is
# the same every step; a longer run only takes longer to simulate: all-reduce on 1,024 nodes
# moves 2 × 1,023 chunks per node and step). Prints samples/s and bytes per sample per run;
# each run's summary.json is under $OUT/<strategy>-<nodes>/. About 12 minutes on 2 cores
# (the parameter server on 1,024 nodes alone takes 8).
#
#   benches/diloco_simulated.sh
#   NODES=64 benches/diloco_simulated.sh
set -eu
cd "$(dirname "$0")/.."
cargo build --release -p ringtmp-cli
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-runs/diloco-simulated}
mkdir -p "$OUT"
for n in ${NODES:-64 1024}; do
    for s in allreduce adpsgd ps diloco rings; do
        case $s in
            diloco) args="--strategy diloco --inner-steps 100 --max-steps 200" ;;
            rings) args="--strategy ring --ring-nodes 4 --replica-sync diloco:100 --max-steps 200" ;;
            ps) args="--strategy ps --server-every 8 --max-steps 20" ;;
            *) args="--strategy $s --max-steps 20" ;;
        esac
        # shellcheck disable=SC2086 # the option lists are meant to split
        "$RINGTMP" simulate $args --nodes "$n" --bandwidth-mbit 100 --latency-ms 2 \
            --node-cpu all:0.25 --batch-size 16 --epochs 1000 --eval-every 0 --overwrite \
            --out "$OUT/$s-$n" > "$OUT-$s-$n.log" 2>&1 || { echo "$s on $n nodes failed: $OUT-$s-$n.log"; continue; }
        echo "$n nodes, $s: $(grep -oE '^simulated: [0-9]+ samples/s' "$OUT-$s-$n.log"), $(grep -oE '\([0-9]+ per sample\)' "$OUT-$s-$n.log")"
    done
done
