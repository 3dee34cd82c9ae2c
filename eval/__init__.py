"""eval/: the measuring instrument — suites, protocols, metrics, baselines, cache, reports — for any
sklearn-style estimator. Imports ``data/`` and third-party libraries only, never the model package
(installed as the ``eval`` subpackage of the distribution; the command line passes estimators in):

    build_public("suites")                                         # the public suites of docs/evaluation-protocol.md
    report = evaluate("classification", "suites", {**baseline_methods("classification"),
                                                   "mine": Method(MyClassifier, version="1")},
                      out_dir="runs/eval/classification")

Modules: ``suites`` (suite format, loading, validation, ``build_public``), ``prepare`` (the
docs/evaluation-protocol.md preparation rules and public dataset specs), ``protocols`` (k-fold, imputation masks,
ADBench splits; the estimator contract), ``metrics``, ``baselines`` / ``imputers`` / ``detectors``
(baseline registries), ``cache``, ``report``, ``runner``.
"""
from .protocols import PROTOCOLS, get_protocol, imputation_mask
from .report import Report, average_ranks, mean_ranks, wins_ties_losses
from .runner import Method, baseline_methods, evaluate
from .suites import TASKS, Dataset, build_public, load_dataset, load_suite, save_dataset

__all__ = [
    "evaluate", "baseline_methods", "Method", "Report",
    "build_public", "load_suite", "load_dataset", "save_dataset", "Dataset", "TASKS",
    "PROTOCOLS", "get_protocol", "imputation_mask",
    "average_ranks", "mean_ranks", "wins_ties_losses",
]
