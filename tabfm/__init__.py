"""tabfm: a tabular foundation model. In-context estimators on top; model and training below.

Importing tabfm is cheap: the estimators (and with them torch and scikit-learn) load on first
use of a name below, so `import tabfm.parallel` and `tabfm --help` import no model code.
"""
from pathlib import Path

from tabfm import _source_tree

__version__ = "0.1.0"
__all__ = ["TabFMClassifier", "TabFMRegressor", "TabFMImputer", "TabFMAnomalyDetector"]

_source_tree.install(Path(__file__).resolve().parent)


def __getattr__(name: str):
    """The estimators, imported on first access (PEP 562)."""
    if name in __all__:
        from tabfm import estimators

        return getattr(estimators, name)
    raise AttributeError(f"module 'tabfm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
