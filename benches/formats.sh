#!/usr/bin/env bash
# MNIST from each format a user brings, against the bundled IDX files: the same model, strategy,
# seed and normalisation, so the accuracy must match and the data path must not slow training.
#
#   benches/formats.sh [OUT]          (default target/formats; REPEATS=3 EPOCHS=1 STRATEGY=local)
#
# Writes MNIST as .npy arrays, CSV tables and PNG folders (the write_formats example), trains
# `mlp` on each REPEATS times, interleaved (IDX, npy, csv with MNIST's constants, csv with the
# per-column default, PNG folders), and prints a table of test accuracy, samples/s (training
# clock) and loading seconds, medians over the repeats, with the ratio of samples/s to IDX's.
set -euo pipefail
OUT=${1:-target/formats}
REPEATS=${REPEATS:-3}
EPOCHS=${EPOCHS:-1}
STRATEGY=${STRATEGY:-local}
cargo build --release -q -p ringtmp-cli
cargo build --release -q -p ringtmp-testkit --example write_formats
bin=./target/release/ringtmp
data=$OUT/data
if [ ! -f "$data/train.csv" ]; then
    ./target/release/examples/write_formats "$data"
fi
# MNIST's own constants in byte units (0.13066049 and 0.30810782 of 255), for a table whose
# values are not scaled.
idx_norm=33.318425/78.567494
mkdir -p "$OUT/runs"
for r in $(seq 1 "$REPEATS"); do
    for fmt in idx npy csv csv-auto images; do
        case $fmt in
            idx) args=(--dataset mnist) ;;
            npy) args=(--dataset npy --data-file "$data/train_x.npy" "$data/test_x.npy"
                       --label-file "$data/train_y.npy" "$data/test_y.npy") ;;
            csv) args=(--dataset csv --data-file "$data/train.csv" "$data/test.csv"
                       --model mlp --normalize "$idx_norm") ;;
            csv-auto) args=(--dataset csv --data-file "$data/train.csv" "$data/test.csv"
                            --model mlp) ;;
            images) args=(--dataset images --data-file "$data/images") ;;
        esac
        run=$OUT/runs/$fmt-$r
        $bin train --strategy "$STRATEGY" --epochs "$EPOCHS" "${args[@]}" --out "$run" \
            --overwrite > "$run.log" 2>&1 || { cat "$run.log"; exit 1; }
    done
done
python3 - "$OUT" "$REPEATS" <<'PY'
import json, re, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
rows = {}
for fmt in ["idx", "npy", "csv", "csv-auto", "images"]:
    acc, sps, load = [], [], []
    for r in range(1, repeats + 1):
        s = json.load(open(f"{out}/runs/{fmt}-{r}/summary.json"))
        acc.append(s["final_test_accuracy"] * 100)
        sps.append(s["samples_per_second"])
        log = open(f"{out}/runs/{fmt}-{r}.log").read()
        m = re.search(r"dataset .*?([0-9.]+)s\)?\n", log)
        load.append(float(m.group(1)) if m else float("nan"))
    rows[fmt] = (statistics.median(acc), min(acc), max(acc), statistics.median(sps),
                 statistics.median(load))
base = rows["idx"][3]
print("| format | test accuracy (median, min–max) | samples/s (median) | vs IDX | load s |")
print("|---|---|---|---|---|")
for fmt, (a, lo, hi, s, l) in rows.items():
    print(f"| {fmt} | {a:.2f}% ({lo:.2f}–{hi:.2f}) | {s:,.0f} | {s / base:.3f} | {l:.1f} |")
PY
