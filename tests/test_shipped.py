"""The shipped weights (tabfm-tiny, tabfm-tiny-cf): load offline with no arguments and predict bundled datasets.

Floors sit below the accuracies measured at release (see BENCHMARKS.md), so the test fails
if the weights, the loader or the estimator path regress, not on seed noise.
"""
import numpy as np
import pytest
from sklearn import datasets
from sklearn.model_selection import train_test_split

from tabfm import TabFMClassifier, TabFMRegressor
from tabfm.weights import DEFAULT_MODELS, resolve_model_path

# dataset -> accuracy floor on a stratified 50/50 split (random_state=0), tabfm-tiny ("auto": one-vs-rest)
# measured 0.947, 0.973, 0.989 (stage 4 + neighbour and linear features, one-vs-rest; 0.940, 0.973, 0.978
# without linear features; 0.944, 0.973, 0.955 without either)
FLOORS = {"breast_cancer": 0.90, "iris": 0.90, "wine": 0.90}


@pytest.mark.parametrize("name", ["tabfm-tiny", "tabfm-tiny-cf"])
def test_shipped_weights_are_present_and_load(name):
    path = resolve_model_path(name)
    assert (path / "model.safetensors").stat().st_size > 100_000


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_tiny_classifier_beats_the_floor(name):
    X, y = getattr(datasets, f"load_{name}")(return_X_y=True, as_frame=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, train_size=0.5, stratify=y, random_state=0)
    clf = TabFMClassifier(model="tabfm-tiny", random_state=0).fit(X_tr, y_tr)
    assert clf._strategy() == "ovr"  # "auto" without context features
    accuracy = float((clf.predict(X_te) == y_te.to_numpy()).mean())
    majority = float(np.bincount(y_te).max() / len(y_te))
    assert accuracy >= FLOORS[name] > majority, (name, accuracy)


def test_default_regressor_beats_the_mean():
    X, y = datasets.load_diabetes(return_X_y=True, as_frame=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, train_size=0.5, random_state=0)
    assert TabFMRegressor().model == DEFAULT_MODELS["regression"] == "tabfm-tiny-cf"
    r2 = TabFMRegressor(random_state=0).fit(X_tr, y_tr).score(X_te, y_te)
    assert r2 > 0.39, r2  # measured 0.446 (tabfm-tiny-cf = refs23, mixed residual / target members, quantile
    # features; 0.436 with every member on the ridge residual; refs18: 0.443 / 0.429; tabfm-tiny 0.435 with the
    # residual and its neighbour and linear features, 0.281 without either)


# tabfm-tiny-cf (pretrained with context features and references), the default classifier: "auto" is "ecoc",
# one n-way pass up to the head's classes (numeric="mixed": half of the members see rank-normal scores);
# measured 0.954, 0.947, 0.978 (refs23; with numeric="raw", the model alone: 0.951, 0.947, 0.966; refs18 0.954,
# 0.960, 0.978 and 0.954, 0.947, 0.978)
CF_FLOORS = {"breast_cancer": 0.94, "iris": 0.93, "wine": 0.95}


@pytest.mark.parametrize("name", sorted(CF_FLOORS))
def test_default_classifier_beats_the_floor(name):
    X, y = getattr(datasets, f"load_{name}")(return_X_y=True, as_frame=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, train_size=0.5, stratify=y, random_state=0)
    clf = TabFMClassifier(random_state=0).fit(X_tr, y_tr)  # no model argument: the shipped default weights
    assert clf.model == "tabfm-tiny-cf" and clf._runtime().context_features == "knn-linear"
    assert clf._strategy() == "ecoc"
    native = TabFMClassifier(multiclass="native", random_state=0).fit(X_tr, y_tr)
    np.testing.assert_array_equal(clf.predict_proba(X_te), native.predict_proba(X_te))  # <= K classes: one pass
    accuracy = float((clf.predict(X_te) == y_te.to_numpy()).mean())
    assert accuracy >= CF_FLOORS[name], (name, accuracy)
