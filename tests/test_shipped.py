"""The shipped tabfm-tiny weights: load offline with no arguments and classify bundled datasets.

Floors sit below the accuracies measured at release (see BENCHMARKS.md), so the test fails
if the weights, the loader or the estimator path regress, not on seed noise.
"""
import numpy as np
import pytest
from sklearn import datasets
from sklearn.model_selection import train_test_split

from tabfm import TabFMClassifier, TabFMRegressor
from tabfm.weights import resolve_model_path

# dataset -> accuracy floor on a stratified 50/50 split (random_state=0)
# measured 0.947, 0.973, 0.989 (stage 4 + neighbour and linear features, one-vs-rest; 0.940, 0.973, 0.978
# without linear features; 0.944, 0.973, 0.955 without either)
FLOORS = {"breast_cancer": 0.90, "iris": 0.90, "wine": 0.90}


def test_shipped_weights_are_present_and_load():
    path = resolve_model_path("tabfm-tiny")
    assert (path / "model.safetensors").stat().st_size > 100_000


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_default_classifier_beats_the_floor(name):
    X, y = getattr(datasets, f"load_{name}")(return_X_y=True, as_frame=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, train_size=0.5, stratify=y, random_state=0)
    clf = TabFMClassifier(random_state=0).fit(X_tr, y_tr)  # no model argument: the shipped weights
    accuracy = float((clf.predict(X_te) == y_te.to_numpy()).mean())
    majority = float(np.bincount(y_te).max() / len(y_te))
    assert accuracy >= FLOORS[name] > majority, (name, accuracy)


def test_default_regressor_beats_the_mean():
    X, y = datasets.load_diabetes(return_X_y=True, as_frame=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, train_size=0.5, random_state=0)
    r2 = TabFMRegressor(random_state=0).fit(X_tr, y_tr).score(X_te, y_te)
    assert r2 > 0.3, r2  # measured 0.435 (stage 4, quantile features, ridge residual, neighbour and linear
    # features; 0.436 before the residual with raw features; 0.414 without linear, 0.281 without either)


# tabfm-tiny-cf (pretrained with context features and references), the model alone: one n-way pass, the
# inputs of its pretraining; measured 0.954, 0.947, 0.978 (refs16, shipped 2026-12-05; real-mix5: 0.951, 0.960, 0.955)
CF_FLOORS = {"breast_cancer": 0.94, "iris": 0.93, "wine": 0.95}


@pytest.mark.parametrize("name", sorted(CF_FLOORS))
def test_context_feature_model_alone_beats_the_floor(name):
    X, y = getattr(datasets, f"load_{name}")(return_X_y=True, as_frame=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, train_size=0.5, stratify=y, random_state=0)
    clf = TabFMClassifier(model="tabfm-tiny-cf", multiclass="native", random_state=0).fit(X_tr, y_tr)
    assert clf._runtime().context_features == "knn-linear"
    accuracy = float((clf.predict(X_te) == y_te.to_numpy()).mean())
    assert accuracy >= CF_FLOORS[name], (name, accuracy)
