"""Metrics of the public protocols (docs/evaluation-protocol.md, "Protocols"), and their directions."""
from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score, log_loss, roc_auc_score

PROB_CLIP = 1e-15

# metric -> True when higher is better
HIGHER_IS_BETTER = {
    "roc_auc": True,
    "accuracy": True,
    "log_loss": False,
    "rmse": False,
    "r2": True,
    "rmse_mcar": False,
    "rmse_mar": False,
    "rmse_mnar": False,
    "rmse_rate_0.1": False,
    "rmse_rate_0.3": False,
    "rmse_rate_0.5": False,
    "cat_accuracy": True,
    "auroc": True,
    "auprc": True,
}

# the metrics reported per task, the first one is the headline metric
TASK_METRICS = {
    "classification": ["roc_auc", "accuracy", "log_loss"],
    "regression": ["rmse", "r2"],
    "imputation": ["rmse", "rmse_mcar", "rmse_mar", "rmse_mnar", "cat_accuracy"],
    "anomaly": ["auroc", "auprc"],
}
# metrics whose mean rank is reported next to the mean (the rest: mean only)
RANKED_METRICS = {
    "classification": ["roc_auc", "accuracy", "log_loss"],
    "regression": ["rmse", "r2"],
    "imputation": ["rmse", "cat_accuracy"],
    "anomaly": ["auroc", "auprc"],
}


def higher_is_better(metric: str) -> bool:
    if metric not in HIGHER_IS_BETTER:
        raise KeyError(f"unknown metric {metric!r}")
    return HIGHER_IS_BETTER[metric]


def clip_renormalise(P: np.ndarray) -> np.ndarray:
    """Clip probabilities to [1e-15, 1] and renormalise each row to sum 1."""
    P = np.clip(np.asarray(P, dtype=np.float64), PROB_CLIP, 1.0)
    return P / P.sum(axis=1, keepdims=True)


def classification_metrics(y: np.ndarray, P: np.ndarray, n_classes: int | None = None) -> dict[str, float]:
    """ROC-AUC (binary: P[:, 1]; multiclass: one-vs-rest macro), accuracy of the arg-max,
    log-loss over labels 0..K-1. ``y`` holds class codes, ``P`` is (n, K) in class-code order."""
    y = np.asarray(y).astype(int)
    P = clip_renormalise(P)
    K = n_classes if n_classes is not None else P.shape[1]
    if P.shape[1] != K:
        raise ValueError(f"probabilities have {P.shape[1]} columns, expected {K}")
    if K == 2:
        auc = roc_auc_score(y, P[:, 1])
    else:
        auc = roc_auc_score(y, P, multi_class="ovr", average="macro", labels=np.arange(K))
    return {
        "roc_auc": float(auc),
        "accuracy": float(np.mean(P.argmax(axis=1) == y)),
        "log_loss": float(log_loss(y, P, labels=np.arange(K))),
    }


def regression_metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    y = np.asarray(y, dtype=float)
    pred = np.asarray(pred, dtype=float).reshape(-1)
    if pred.shape != y.shape:
        raise ValueError(f"predictions have shape {pred.shape}, expected {y.shape}")
    resid = y - pred
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return {
        "rmse": float(np.sqrt(np.mean(resid**2))),
        "r2": float(1.0 - np.sum(resid**2) / ss_tot) if ss_tot > 0 else float("nan"),
    }


def anomaly_metrics(y: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """AUROC and AUPRC (average precision) of anomaly scores, higher = more anomalous."""
    y = np.asarray(y).astype(int)
    s = np.asarray(scores, dtype=float).reshape(-1)
    if not np.all(np.isfinite(s)):
        raise ValueError("anomaly scores contain NaN or inf")
    return {"auroc": float(roc_auc_score(y, s)), "auprc": float(average_precision_score(y, s))}


def imputation_errors(true_num: np.ndarray, imputed_num: np.ndarray, std: np.ndarray, mask_num: np.ndarray,
                      true_cat: np.ndarray, imputed_cat: np.ndarray, mask_cat: np.ndarray) -> dict[str, float]:
    """Standardised RMSE over all masked numeric cells (each error divided by its column's std)
    and accuracy over all masked categorical cells (NaN when there are none).

    Numeric arrays are (n, p_num) floats, ``std`` is (p_num,); categorical arrays are (n, p_cat)
    integer codes; masks are boolean of the same shapes."""
    out = {}
    if mask_num.any():
        err = (np.asarray(imputed_num, float) - np.asarray(true_num, float)) / np.asarray(std, float)[None, :]
        out["rmse"] = float(np.sqrt(np.mean(err[mask_num] ** 2)))
    else:
        out["rmse"] = float("nan")
    if mask_cat.any():
        out["cat_accuracy"] = float(np.mean(np.asarray(imputed_cat)[mask_cat] == np.asarray(true_cat)[mask_cat]))
    else:
        out["cat_accuracy"] = float("nan")
    return out
