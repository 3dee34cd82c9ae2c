"""Experiment: residual and plain members (n each) combined per row: equal weights, inverse predictive variance, 3:1."""
import json, sys, time
import numpy as np, torch
from tabfm.estimators import TabFMRegressor
from tabfm.eval.protocols import regression_splits
from tabfm.eval.suites import load_suite
from sklearn.metrics import r2_score

torch.set_num_threads(1)
model, n, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
suite = load_suite("runs/regression-suite", "regression")
out = {}
for ds in suite:
    t0 = time.perf_counter()
    X, y = ds.X, ds.frame[ds.target].to_numpy(dtype=np.float64)
    scores = {}
    for tr, te in regression_splits(len(y)):
        Xtr, Xte = X.iloc[tr].reset_index(drop=True), X.iloc[te].reset_index(drop=True)
        a = TabFMRegressor(model=model, n_estimators=n, random_state=0, progress=False).fit(Xtr, y[tr])
        b = TabFMRegressor(model=model, n_estimators=n, random_state=1, progress=False, linear_residual=False).fit(Xtr, y[tr])
        ma, qa = a._distribution(Xte, [0.16, 0.84])
        mb, qb = b._distribution(Xte, [0.16, 0.84])
        va, vb = ((qa[:, 1] - qa[:, 0]) / 2) ** 2 + 1e-12, ((qb[:, 1] - qb[:, 0]) / 2) ** 2 + 1e-12
        wa = (1 / va) / (1 / va + 1 / vb)
        preds = {"resid": ma, "plain": mb, "half": 0.5 * (ma + mb), "w75": 0.75 * ma + 0.25 * mb,
                 "iv": wa * ma + (1 - wa) * mb}
        for k, p in preds.items():
            scores.setdefault(k, []).append(r2_score(y[te], p))
    out[ds.name] = {k: float(np.mean(v)) for k, v in scores.items()}
    print(ds.name, {k: round(v, 4) for k, v in out[ds.name].items()}, round(time.perf_counter() - t0, 1), flush=True)
means = {k: float(np.mean([out[d][k] for d in out])) for k in out[next(iter(out))]}
print("mean", means)
json.dump({"per_dataset": out, "mean": means}, open(out_path, "w"), indent=1)
