"""Anomaly-detection baselines, all following one sign convention:

    ``fit(X_train)`` (unlabelled) and ``score_samples(X_test)`` -> higher = MORE anomalous.

pyod detectors already score that way (``decision_function``); sklearn detectors
(``IsolationForest``, ``LocalOutlierFactor(novelty=True)``, ``OneClassSVM``) score the other way
round (higher = more normal), so :class:`Negated` flips them.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import numpy as np
from sklearn.base import BaseEstimator

Factory = Callable[[], Any]


def _array(X) -> np.ndarray:
    return np.asarray(X, dtype=np.float64)


class PyODDetector(BaseEstimator):
    """A pyod model (``pyod.models.<module>.<cls>(**params)``); score = ``decision_function``."""

    def __init__(self, module: str, cls: str, params: dict | None = None):
        self.module = module
        self.cls = cls
        self.params = params

    def fit(self, X, y=None):
        model_cls = getattr(importlib.import_module(f"pyod.models.{self.module}"), self.cls)
        self.model_ = model_cls(**(self.params or {}))
        self.model_.fit(_array(X))
        return self

    def score_samples(self, X) -> np.ndarray:
        return np.asarray(self.model_.decision_function(_array(X)), dtype=np.float64)


class Negated(BaseEstimator):
    """Wrap an sklearn detector whose ``score_samples`` is higher-for-normal: returns its negative."""

    def __init__(self, detector):
        self.detector = detector

    def fit(self, X, y=None):
        from sklearn.base import clone

        self.detector_ = clone(self.detector).fit(X)
        return self

    def score_samples(self, X) -> np.ndarray:
        return -np.asarray(self.detector_.score_samples(X), dtype=np.float64)


# pyod defaults; random_state=0 where the detector is randomised (IForest), for reproducibility
PYOD_BASELINES = {
    "iforest": ("iforest", "IForest", {"random_state": 0}),
    "lof": ("lof", "LOF", {}),
    "knn": ("knn", "KNN", {}),
    "ocsvm": ("ocsvm", "OCSVM", {}),
    "ecod": ("ecod", "ECOD", {}),
    "copod": ("copod", "COPOD", {}),
}


def detector_baselines() -> dict[str, Factory]:
    """pyod baselines when pyod is installed, else none (the registry warns)."""
    try:
        importlib.import_module("pyod")
    except ImportError:
        return {}
    return {name: (lambda m=m, c=c, p=p: PyODDetector(m, c, dict(p))) for name, (m, c, p) in PYOD_BASELINES.items()}


def sklearn_iforest(random_state: int = 0) -> Negated:
    """sklearn IsolationForest with pyod's IForest defaults, higher = more anomalous."""
    from sklearn.ensemble import IsolationForest

    return Negated(IsolationForest(random_state=random_state))
