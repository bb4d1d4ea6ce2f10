#!/usr/bin/env python3
"""The defaults sweep's table (benches/defaults_sweep.sh): for every model and strategy, the
final test accuracy (or validation loss) of every learning rate × momentum run, the best run,
the run on the strategy's defaults, and how far the defaults are from the best against the rule
of docs/decisions/defaults.md (within 0.3 points of accuracy, or 2% of loss).

    python3 benches/defaults_table.py docs/reports/defaults-sweep/results.jsonl
"""

import json
import sys
from collections import defaultdict


def main(path):
    runs = defaultdict(list)
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                r = json.loads(line)
                runs[(r["model"], r["strategy"])].append(r)
    models = sorted({m for m, _ in runs}, key=["mlp", "cnn", "mlp-deep", "gpt-cpu"].index)
    print("# Defaults sweep\n")
    print("Final test accuracy (%) after the budget, or final validation loss for a language")
    print("model; **bold** the best of the strategy's row, *(d)* the strategy's defaults.")
    print("Within the rule: the defaults at most 0.3 points (or 2% of loss) from the best.\n")
    for model in models:
        print(f"## {model}\n")
        lm = any(r["final_val_loss"] is not None for (m, _), rs in runs.items() if m == model for r in rs)
        strategies = [s for (m, s) in runs if m == model]
        print("| strategy | runs (lr, momentum: result) | best | defaults | gap | within |")
        print("|---|---|---|---|---|---|")
        for strategy in strategies:
            rs = runs[(model, strategy)]

            def score(r):
                return r["final_val_loss"] if lm else 100.0 * r["final_accuracy"]

            def better(a, b):
                return a < b if lm else a > b

            def label(r):
                m = "" if r["momentum"] is None else f", {r['momentum']:g}"
                return f"{r['lr']:g}{m}"

            best = rs[0]
            for r in rs[1:]:
                if better(score(r), score(best)):
                    best = r
            defaults = next((r for r in rs if r["defaults"]), None)
            cells = []
            seen = set()
            for r in sorted(rs, key=lambda r: (r["lr"], r["momentum"] or 0.0, not r["defaults"])):
                key = (r["lr"], r["momentum"])
                tag = " *(d)*" if r["defaults"] else ""
                if key in seen and not r["defaults"]:
                    continue
                seen.add(key)
                value = f"{score(r):.3f}" if lm else f"{score(r):.2f}"
                if r is best:
                    value = f"**{value}**"
                cells.append(f"{label(r)}: {value}{tag}")
            if defaults is None:
                gap, within, dval = "", "", ""
            else:
                if lm:
                    g = (score(defaults) - score(best)) / score(best) * 100.0
                    gap = f"{g:.1f}%"
                    within = "yes" if g <= 2.0 else "**no**"
                    dval = f"{score(defaults):.3f} ({label(defaults)})"
                else:
                    g = score(best) - score(defaults)
                    gap = f"{g:.2f}"
                    within = "yes" if g <= 0.3 else "**no**"
                    dval = f"{score(defaults):.2f} ({label(defaults)})"
            bval = f"{score(best):.3f}" if lm else f"{score(best):.2f}"
            print(
                f"| {strategy} | {'; '.join(cells)} | {bval} ({label(best)}) | {dval} | {gap} | {within} |"
            )
        print()


if __name__ == "__main__":
    main(sys.argv[1])
