"""tabfm: a tabular foundation model. In-context estimators on top; model and training below."""
from tabfm.estimators import TabFMAnomalyDetector, TabFMClassifier, TabFMImputer, TabFMRegressor

__all__ = ["TabFMClassifier", "TabFMRegressor", "TabFMImputer", "TabFMAnomalyDetector"]
__version__ = "0.1.0"
