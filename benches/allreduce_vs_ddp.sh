#!/usr/bin/env bash
# Ring all-reduce SGD against PyTorch DistributedDataParallel (gloo) on one machine, side by side:
# the same job (`mlp`, MNIST, 4 workers × 64, SGD momentum 0.9 at 0.04, STEPS steps), interleaved
# so drift on a shared machine falls on every row alike.
#
#   benches/allreduce_vs_ddp.sh            (ROUNDS=3 STEPS=300 WORKERS=4)
#
# Needs `pip install torch numpy` for the reference. Prints each round's samples/s (the training
# clock of rank 0 / node 0) and, per row, the median and its ratio to DDP's median: ringtmp with
# private links (the default: AES-256-GCM where both ends have AES instructions, ChaCha20-Poly1305
# elsewhere) and with `--insecure-plaintext`. `BEFORE=path/to/ringtmp` adds both rows for another
# build of ringtmp (an older commit's, say) in the same rounds.
set -euo pipefail
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-300}
WORKERS=${WORKERS:-4}
cargo build --release -q -p ringtmp-cli
bin=./target/release/ringtmp
lscpu | grep -E "^(Model name|CPU family|Model|CPU\(s\)):" | tr -s ' '
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
rows=(ddp private plaintext)
if [ -n "${BEFORE:-}" ]; then
    rows+=(before-private before-plaintext)
fi
ringtmp_rate() { # the samples/s of node 0's last line, of the binary $run_bin
    "$run_bin" train --strategy allreduce --nodes "$WORKERS" --max-steps "$STEPS" --eval-every 0 \
        --out "$out/run" --overwrite "$@" 2>&1 | grep -o '[0-9]* samples/s' | tail -1 | cut -d' ' -f1
}
for r in $(seq 1 "$ROUNDS"); do
    for row in "${rows[@]}"; do
        case $row in
            ddp) rate=$(python3 benches/reference/ddp_mnist.py --workers "$WORKERS" \
                    --steps "$STEPS" | grep -o '[0-9]* samples/s' | tail -1 | cut -d' ' -f1) ;;
            private) rate=$(run_bin=$bin ringtmp_rate) ;;
            plaintext) rate=$(run_bin=$bin ringtmp_rate --insecure-plaintext) ;;
            before-private) rate=$(run_bin=$BEFORE ringtmp_rate) ;;
            before-plaintext) rate=$(run_bin=$BEFORE ringtmp_rate --insecure-plaintext) ;;
        esac
        echo "round $r $row $rate" | tee -a "$out/rates"
    done
done
python3 - "$out/rates" <<'EOF'
import statistics, sys
rates = {}
for line in open(sys.argv[1]):
    _, _, row, rate = line.split()
    rates.setdefault(row, []).append(float(rate))
ddp = statistics.median(rates["ddp"])
names = {"ddp": "PyTorch DDP (gloo)", "private": "ringtmp all-reduce, private links",
         "plaintext": "ringtmp all-reduce, --insecure-plaintext",
         "before-private": "BEFORE's all-reduce, private links",
         "before-plaintext": "BEFORE's all-reduce, --insecure-plaintext"}
print(f"\n| run | samples/s per round | median | × DDP |\n|---|---|---|---|")
for row, values in rates.items():
    med = statistics.median(values)
    rounds = " / ".join(f"{v:,.0f}" for v in values)
    print(f"| {names[row]} | {rounds} | {med:,.0f} | {med / ddp:.2f} |")
EOF
