#!/usr/bin/env bash
# scikit-learn's bundled tables with ringtmp's plain command beside scikit-learn on the same
# splits: benches/reference/sklearn_tables.py writes each table's 75/25 split and scores
# LogisticRegression / MLPClassifier / RandomForest (Ridge / MLPRegressor / RandomForest for the
# regression); ringtmp trains on the training file alone with nothing but the data named (it
# holds out its own validation rows, keeps the best evaluation's checkpoint) and `ringtmp eval`
# scores that checkpoint on the test file. Each table is trained twice: the same seed must give
# the same numbers.
#
#   benches/small_tables.sh            # needs python3 with scikit-learn
#   RINGTMP=target/release/ringtmp OUT=/tmp/tables benches/small_tables.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RINGTMP=${RINGTMP:-target/release/ringtmp}
OUT=${OUT:-$(mktemp -d)}
[ -x "$RINGTMP" ] || cargo build --release -p ringtmp-cli
lscpu | grep -m1 'Model name' || true
mkdir -p "$OUT/runs"
python3 benches/reference/sklearn_tables.py "$OUT/tables" > "$OUT/sklearn.jsonl" 2>/dev/null
echo "| table | rows (train/test) | scikit-learn (LR / MLP / RF, or Ridge / MLP / RF) | ringtmp plain command | steps, best checkpoint | same numbers twice |"
echo "|---|---|---|---|---|---|"
while read -r line; do
  table=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["table"])' "$line")
  scores=()
  for run in 1 2; do
    "$RINGTMP" train --dataset csv --data-file "$OUT/tables/$table/train.csv" \
      --out "$OUT/runs/$table-$run" --overwrite > "$OUT/runs-$table-$run.log" 2>&1
    scores+=("$("$RINGTMP" eval --checkpoint "$OUT/runs/$table-$run" \
      --data-file "$OUT/tables/$table/test.csv" --json 2>/dev/null)")
  done
  python3 - "$line" "${scores[0]}" "${scores[1]}" "$OUT/runs/$table-1/summary.json" <<'EOF'
import json, sys
ref, a, b, summary = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.load(open(sys.argv[4]))
fmt = (lambda v: f"{100 * v:.2f}%") if ref["metric"] == "accuracy" else (lambda v: f"R² {v:.3f}")
key = "accuracy" if ref["metric"] == "accuracy" else "r2"
sk = " / ".join(fmt(v) for v in ref["scores"].values())
same = "yes" if a[key] == b[key] and a["step"] == b["step"] else f"no ({fmt(b[key])})"
print(f"| {ref['table']} | {ref['rows'][0]}/{ref['rows'][1]} | {sk} | {fmt(a[key])} | "
      f"{summary['steps']}, step {a['step']} | {same} |")
EOF
done < "$OUT/sklearn.jsonl"
echo "output in $OUT"
