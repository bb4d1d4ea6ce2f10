#!/usr/bin/env python3
"""Issue 15.3: the simulator against real runs.

For every run of a `ringtmp compare` report (real local nodes, emulated links and CPU quotas), runs
`ringtmp simulate` with the same options and prints, side by side, training samples/s and the
bytes sent for training (evaluation traffic excluded), with the simulated/real ratio. The cost
model is measured once per model, on this machine, before any simulation (run it on an idle
machine: the measurement is what the simulator charges).

    benches/validate_sim.py docs/reports/edge-4x100mbit            # every model in the report
    RINGTMP=target/release/ringtmp benches/validate_sim.py DIR mlp  # one model
    COSTS=/tmp/costs benches/validate_sim.py DIR  # keep the cost models in /tmp/costs/<model>.json
                                                  # and reuse them (two binaries, one measurement)

Writes DIR/<model>/simulated.jsonl (one line per run) and prints a markdown table.
"""

import json
import os
import subprocess
import sys
import tempfile


def training_bytes(summary):
    return sum(n["bytes_sent"] - n.get("eval_bytes_sent", 0) for n in summary["per_node"])


def real_training_bytes(report, model, result):
    """A real run's bytes sent for training: from its line of results.jsonl, or, for reports
    made before that line carried them, from the run's own summary under runs/ (published
    reports leave runs/ out: make the report again with its script)."""
    if "training_bytes_sent" in result:
        return result["training_bytes_sent"]
    path = os.path.join(report, model, "runs", result["run"], "summary.json")
    if not os.path.exists(path):
        sys.exit(f"{path}: missing, and results.jsonl has no training_bytes_sent; "
                 "make the report again with its script (benches/edge_report.sh)")
    return training_bytes(json.load(open(path)))


def simulate_args(args):
    """The run's `train` options, evaluated only at the end (evaluations take no virtual time)."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--eval-every":
            skip = True
            continue
        out.append(a)
    return out + ["--eval-every", "0"]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    report = sys.argv[1]
    models = sys.argv[2:] or sorted(
        d for d in os.listdir(report) if os.path.exists(os.path.join(report, d, "results.jsonl"))
    )
    binary = os.environ.get("RINGTMP", "target/release/ringtmp")
    rows = []
    for model in models:
        results = [json.loads(l) for l in open(os.path.join(report, model, "results.jsonl"))]
        work = tempfile.mkdtemp(prefix=f"validate-{model}-")
        costs = os.path.join(work, "cost-model.json")
        if os.environ.get("COSTS"):
            os.makedirs(os.environ["COSTS"], exist_ok=True)
            costs = os.path.join(os.environ["COSTS"], f"{model}.json")
        simulated = []
        for r in results:
            args = simulate_args(r["args"])
            out = os.path.join(work, r["run"])
            cmd = [binary, "simulate", *args, "--out", out, "--overwrite"]
            cmd += ["--cost-model", costs] if os.path.exists(costs) else ["--save-cost-model", costs]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{model} {r['run']}: simulate failed:\n{done.stderr}", file=sys.stderr)
                continue
            sim = json.load(open(os.path.join(out, "summary.json")))
            line = {
                "model": model,
                "run": r["run"],
                "real_samples_per_second": r["samples_per_second"],
                "sim_samples_per_second": sim["samples_per_second"],
                "real_training_bytes": real_training_bytes(report, model, r),
                "sim_training_bytes": training_bytes(sim),
                "command": " ".join(["ringtmp", "simulate", *args]),
            }
            simulated.append(line)
            rows.append(line)
            print(f"{model} {r['run']}: done", file=sys.stderr)
        with open(os.path.join(report, model, "simulated.jsonl"), "w") as f:
            for line in simulated:
                f.write(json.dumps(line) + "\n")
    print("| model | run | real samples/s | simulated | ratio | real training bytes | simulated | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for l in rows:
        rs, ss = l["real_samples_per_second"], l["sim_samples_per_second"]
        rb, sb = l["real_training_bytes"], l["sim_training_bytes"]
        print(
            f"| {l['model']} | {l['run']} | {rs:,.1f} | {ss:,.1f} | {ss / rs:.2f} "
            f"| {rb / 1e6:,.1f} MB | {sb / 1e6:,.1f} MB | {sb / rb:.3f} |"
        )


if __name__ == "__main__":
    main()
