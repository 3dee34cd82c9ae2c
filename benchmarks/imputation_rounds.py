"""TabFMImputer's rounds (`n_rounds`) and strategies on the public imputation suite, scored as `tabfm eval` scores it.

For each dataset of the suite and each condition (mechanism x rate x seed) of
tabfm.eval.protocols.imputation_conditions, the cells of imputation_mask are hidden (apply_mask),
the imputer fits and transforms the masked table (fit_transform, as run_imputation calls it, with
the estimator eval builds: the given model, random_state=0, defaults otherwise), and
score_imputation gives the standardised RMSE over the masked numeric cells and the accuracy over
the masked categorical ones. Every n_rounds setting sees the same masks. Aggregates: mean over
the conditions of a dataset, then over datasets (as the eval report's per-dataset means); by
mechanism and by rate likewise. Seconds: the fit_transform calls of a setting, summed. Prints a
table, writes JSON.

The full suite (8 datasets x 27 conditions) takes ~25 min per setting on one thread; the default
is a subset: 4 datasets x the 9 mechanism/rate conditions x seed 0.

    nice -n 10 python benchmarks/imputation_rounds.py                    # the subset, rounds 1,2,3 (joint)
    nice -n 10 python benchmarks/imputation_rounds.py --settings columns:1,columns:2,joint:1
    nice -n 10 python benchmarks/imputation_rounds.py --datasets all --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tabfm.estimators import TabFMImputer
from tabfm.estimators.imputer import DEFAULT_ROUND_PARTS
from tabfm.eval.protocols import MECHANISMS, RATES, apply_mask, imputation_conditions, imputation_mask, score_imputation
from tabfm.eval.suites import default_public_dir, load_suite
from tabfm.weights import DEFAULT_MODELS

from common import machine_info

DEFAULT_DATASETS = "boston,penguins,concrete,credit_data"


def nanmean(values) -> float:
    v = np.asarray(list(values), dtype=float)
    v = v[~np.isnan(v)]
    return float(v.mean()) if v.size else float("nan")


def summarise(units: list[dict], datasets: list[str]) -> dict:
    """Dataset means, then their mean: overall, by mechanism, by rate (rmse, cat_accuracy)."""
    def over(pick) -> dict:
        per = {d: [u for u in units if u["dataset"] == d and pick(u)] for d in datasets}
        return {m: nanmean(nanmean(u[m] for u in us) for us in per.values() if us) for m in ("rmse", "cat_accuracy")}

    out = {"all": over(lambda u: True)}
    out.update({mech: over(lambda u, m=mech: u["mechanism"] == m) for mech in MECHANISMS})
    out.update({f"rate_{r}": over(lambda u, r=r: u["rate"] == r) for r in RATES})
    out["per_dataset"] = {d: nanmean(u["rmse"] for u in units if u["dataset"] == d) for d in datasets}
    out["seconds"] = float(sum(u["seconds"] for u in units))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(default_public_dir() / "imputation"))
    ap.add_argument("--datasets", default=DEFAULT_DATASETS, help="comma-separated names, or 'all'")
    ap.add_argument("--seeds", default="0", help="mask seeds of imputation_conditions (0,1,2 = the full protocol)")
    ap.add_argument("--settings", default="joint:1,joint:2,joint:3",
                    help="comma-separated STRATEGY:N_ROUNDS[:LOCAL_CONTEXT] imputer settings (strategy 'columns' or "
                         "'joint'; LOCAL_CONTEXT: the column estimators' local_context, default the imputer's)")
    ap.add_argument("--round-parts", type=int, default=DEFAULT_ROUND_PARTS)
    ap.add_argument("--model", default=DEFAULT_MODELS["imputation"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "imputation_rounds.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    names = None if args.datasets == "all" else args.datasets.split(",")
    suite = load_suite(args.suite, "imputation", names)
    seeds = {int(s) for s in args.seeds.split(",")}
    rounds = args.settings.split(",")  # one label per setting, "strategy:n_rounds[:local_context]"
    for r in rounds:
        if r.count(":") not in (1, 2) or not all(p.isdigit() for p in r.split(":")[1:]):
            ap.error(f"--settings entries are STRATEGY:N_ROUNDS[:LOCAL_CONTEXT], got {r!r}")
    conditions = [c for c in imputation_conditions() if c[2] in seeds]
    units: dict[str, list[dict]] = {r: [] for r in rounds}
    t_all = time.perf_counter()
    for ds in suite:
        frame = ds.frame if ds.target is None else ds.frame.drop(columns=[ds.target])
        for mech, rate, seed in conditions:
            M = imputation_mask(frame, mech, rate, seed)
            masked = apply_mask(frame, M)
            for r in rounds:
                strategy, n, *local = r.split(":")
                extra = {"local_context": int(local[0])} if local else {}
                est = TabFMImputer(model=args.model, random_state=0, strategy=strategy, n_rounds=int(n),
                                   round_parts=args.round_parts, **extra)
                t0 = time.perf_counter()
                out = est.fit_transform(masked)
                sec = time.perf_counter() - t0
                units[r].append({"dataset": ds.name, "mechanism": mech, "rate": rate, "seed": seed, "seconds": sec,
                                 **score_imputation(frame, M, out)})
            line = "  ".join(f"{r} {units[r][-1]['rmse']:.4f} ({units[r][-1]['seconds']:.1f}s)" for r in rounds)
            print(f"{ds.name:12s} {mech:4s} {rate:.1f} s{seed}  {line}", flush=True)

    datasets = [ds.name for ds in suite]
    summary = {r: summarise(units[r], datasets) for r in rounds}
    cols = ["all", *MECHANISMS, *(f"rate_{r}" for r in RATES)]
    print(f"\n{len(datasets)} datasets ({', '.join(datasets)}) x {len(conditions)} conditions "
          f"(seeds {sorted(seeds)}); round_parts={args.round_parts}; standardised RMSE (lower is better)")
    print("| strategy:n_rounds | " + " | ".join(cols) + " | cat. accuracy | seconds |")
    print("|---:|" + "---:|" * (len(cols) + 2))
    for r in rounds:
        s = summary[r]
        print(f"| {r} | " + " | ".join(f"{s[c]['rmse']:.4f}" for c in cols)
              + f" | {s['all']['cat_accuracy']:.4f} | {s['seconds']:.0f} |")
    print("\nper dataset RMSE: " + "; ".join(
        f"{d} " + " / ".join(f"{summary[r]['per_dataset'][d]:.4f}" for r in rounds) for d in datasets))

    record = {"benchmark": "imputation_rounds", "model": args.model, "settings": rounds, "suite": args.suite, "datasets": datasets,
              "seeds": sorted(seeds), "n_conditions": len(conditions), "round_parts": args.round_parts,
              "subset_note": None if names is None and seeds == {0, 1, 2} else
              "a subset of the public imputation suite (not the full 8 datasets x 27 conditions)",
              "summary": {str(r): summary[r] for r in rounds}, "units": {str(r): units[r] for r in rounds},
              "wall_seconds": time.perf_counter() - t_all, "threads": args.threads, "machine": machine_info()}
    record["machine"]["torch_threads_per_rank"] = args.threads
    record["machine"].pop("backend", None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
