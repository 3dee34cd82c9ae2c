"""benchmarks/context_columns.py: each context-column group read as a classifier on its own."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import load_breast_cancer, load_iris

from tabfm.eval.suites import save_dataset


def test_group_probabilities_by_hand(load_benchmark):
    """K - 1 class columns -> p(1..K-1) clipped to [0, 1], p(0) = 1 - their sum (clipped), renormalised."""
    bench = load_benchmark("context_columns")
    p = bench.group_probabilities(np.array([[0.2, 0.3], [0.9, 0.6], [-0.5, 0.25]]))
    expected = np.array([[0.5, 0.2, 0.3], [0.0, 0.9, 0.6], [0.75, 0.0, 0.25]]) + 1e-6
    np.testing.assert_allclose(p, expected / expected.sum(1, keepdims=True))


@pytest.fixture
def suite(tmp_path):
    iris = load_iris(as_frame=True).frame
    iris["target"] = pd.Categorical(iris["target"].map({0: "setosa", 1: "versicolor", 2: "virginica"}))
    cancer = load_breast_cancer(as_frame=True).frame.iloc[:300, [0, 1, 2, 20, 21, 22, 30]]
    cancer["target"] = pd.Categorical(cancer["target"].astype(str))
    save_dataset(tmp_path / "suite", "iris", iris, "classification", "target")
    save_dataset(tmp_path / "suite", "cancer", cancer, "classification", "target")
    return tmp_path / "suite"


def test_script_scores_groups_and_sets_the_model_beside_them(load_benchmark, suite, tmp_path, capsys):
    """Two folds of two easy tables: every group alone separates the classes; the report's model
    scores are read per table, and a table where the model is below its best group is named."""
    bench = load_benchmark("context_columns")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"methods": ["tabfm"], "per_dataset": {
        "iris": {"tabfm": {"roc_auc": 0.5, "accuracy": 0.3, "log_loss": 1.0}},
        "cancer": {"tabfm": {"roc_auc": 1.0, "accuracy": 1.0, "log_loss": 0.0}}}}))
    record = bench.main(["--suite", str(suite), "--report", str(report), "--folds", "2", "--json", str(tmp_path / "cc.json")])
    rows = {r["dataset"]: r for r in record["rows"]}
    assert set(rows) == {"iris", "cancer"} and rows["iris"]["classes"] == 3 and rows["iris"]["folds"] == 2
    for r in rows.values():
        assert all(r[g]["roc_auc"] > 0.9 for g in ("knn5", "knn20", "ridge"))
        assert r["best_group"] == max(("knn5", "knn20", "ridge"), key=lambda g: r[g]["roc_auc"])
    assert record["summary"]["model_below_best_group"] == ["iris"]
    assert record["summary"]["mean_model"] == pytest.approx(0.75)
    assert json.loads((tmp_path / "cc.json").read_text())["summary"] == record["summary"]
    assert "| iris | 3 |" in capsys.readouterr().out
