"""sklearn-style estimators on top of the pretrained table model (in-context: no weight is updated).

TabFMClassifier, TabFMRegressor, TabFMImputer, TabFMAnomalyDetector share one base
(`base.TabFMEstimator`: parameters, input checks, running the model) and one ensemble
(`ensemble`: column/code/class permutations, column groups, context subsampling).
"""
from .anomaly import TabFMAnomalyDetector
from .base import TabFMEstimator
from .classifier import TabFMClassifier
from .imputer import TabFMImputer
from .regressor import TabFMRegressor

__all__ = ["TabFMClassifier", "TabFMRegressor", "TabFMImputer", "TabFMAnomalyDetector", "TabFMEstimator"]
