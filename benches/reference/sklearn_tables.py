#!/usr/bin/env python3
"""scikit-learn's bundled tables as CSV splits, and scikit-learn's own scores on them.

Writes OUT/{wine,breast_cancer,digits,diabetes}/{train,test}.csv (a seeded 75/25 split,
stratified for the classifications; the label in a column named `label`, the regression's
written as reals, as pandas writes them) and prints one JSON line per table with the test
scores of LogisticRegression, MLPClassifier and RandomForestClassifier (accuracy) or Ridge,
MLPRegressor and RandomForestRegressor (R²), each on the same split with the same
standardisation a user would give them (a StandardScaler fitted on the training rows).
benches/small_tables.sh runs ringtmp's plain command beside it.

    python3 benches/reference/sklearn_tables.py OUT
"""

import csv
import json
import sys
from pathlib import Path

from sklearn import datasets
from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

TABLES = {
    "wine": (datasets.load_wine, True),
    "breast_cancer": (datasets.load_breast_cancer, True),
    "digits": (datasets.load_digits, True),
    "diabetes": (datasets.load_diabetes, False),
}
SEED = 0


def write(path, x, y, columns, real_label):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(columns) + ["label"])
        for row, label in zip(x, y):
            w.writerow([repr(float(v)) for v in row] + [float(label) if real_label else int(label)])


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tables")
    for name, (load, classify) in TABLES.items():
        d = load()
        x, y = d.data, d.target
        columns = [f"f{i}" for i in range(x.shape[1])]
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=0.25, random_state=SEED, stratify=y if classify else None
        )
        (out / name).mkdir(parents=True, exist_ok=True)
        write(out / name / "train.csv", x_tr, y_tr, columns, not classify)
        write(out / name / "test.csv", x_te, y_te, columns, not classify)
        if classify:
            models = {
                "logistic_regression": LogisticRegression(max_iter=5000),
                "mlp": MLPClassifier(max_iter=2000, random_state=SEED),
                "random_forest": RandomForestClassifier(random_state=SEED),
            }
        else:
            models = {
                "ridge": Ridge(),
                "mlp": MLPRegressor(max_iter=5000, random_state=SEED),
                "random_forest": RandomForestRegressor(random_state=SEED),
            }
        scores = {}
        for label, model in models.items():
            pipe = make_pipeline(StandardScaler(), model).fit(x_tr, y_tr)
            scores[label] = round(float(pipe.score(x_te, y_te)), 4)
        print(json.dumps({
            "table": name,
            "rows": [len(y_tr), len(y_te)],
            "columns": x.shape[1],
            "metric": "accuracy" if classify else "r2",
            "scores": scores,
        }))


if __name__ == "__main__":
    main()
