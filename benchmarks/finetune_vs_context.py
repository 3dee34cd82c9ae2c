"""Fine-tuning vs in-context prediction, per table of the public classification suite or the regression suite (issue #24).

    nice -n 10 python benchmarks/finetune_vs_context.py --quick                 # one tiny table, seconds of training
    nice -n 10 python benchmarks/finetune_vs_context.py --minutes 1.5 --lora-ranks 8
    nice -n 10 python benchmarks/finetune_vs_context.py --tables german,australian --lora-ranks 4,8,16
    nice -n 10 python benchmarks/finetune_vs_context.py --task regression --lora-ranks 8   # runs/regression-suite
    nice -n 10 python benchmarks/finetune_vs_context.py --tables phoneme --preset long --minutes 4 --lora-ranks ''

For each table: the first fold (or each of --protocol-folds) of the public protocol's split (`tabfm.eval.protocols.classification_splits`,
stratified 5-fold, seed 0, as `tabfm eval` runs it) gives train and test rows. On the TEST rows,
every variant is scored by `TabFMClassifier(model=..., **estimator_params)` fitted on the train rows,
with the same estimator parameters (`HoldoutEval.params_for`, the ones fine-tuning scores its
held-out rows with and records in OUT/export/config.json; checked equal after every run), and the
protocol's metrics (`tabfm.eval.metrics.classification_metrics`: ROC-AUC, accuracy, log-loss).
With --task regression the same with the regression protocol's first fold (`regression_splits`,
shuffled 5-fold, seed 0), `TabFMRegressor` and `regression_metrics` (R^2, RMSE), on the suite that
`benchmarks/regression_suite.py` builds (default runs/regression-suite):

    in-context   the init's weights, no weight update
    full         `finetune()` on the train rows only (its own stratified holdout of them picks the best
                 step), every parameter trained, a fixed wall budget --minutes per run
    lora-R       the same with low-rank adapters of rank R (merged into the export)

--protocol-folds 0,1,2,3,4 runs every table on those folds of the protocol (fine-tuning on each fold's
train rows, scoring its test rows) and reports the mean over them, as `tabfm eval` scores a table, with
the number of folds on which each variant beat in context.

--folds 1,5 runs every fine-tuned variant once per value of FinetuneConfig.folds (K >= 2: named
...-k5; K fold runs, each --minutes long, the step chosen on all training rows pooled and the K
runs' weights averaged at it, `tabfm finetune --folds K`).

--significance 0,2 runs every fine-tuned variant once per value of FinetuneConfig.significance
(named full-z0, full-z2, ...): the same training, a different rule for which evaluated step is
exported (any lower held-out score, or one lower by more than Z paired standard errors).

Fine-tuning runs with the default preset and steps=--steps (default 100000: the budget binds, so the
cosine schedule is effectively flat at lr after warm-up), threads=1, and two settings scaled to a budget
of tens of steps (a step of the default 16k-cell episodes takes ~2.5 s on one shared CPU thread):
held-out evaluation every --eval-every 10 steps (FinetuneConfig: 25) and --warmup-steps 5
(FinetuneConfig: 20); the FinetuneConfig defaults otherwise (lr 1e-4 for full and LoRA unless --lora-lr,
patience 4: a run can stop early; its evaluations count in its budget). --preset long runs that preset's
settings instead (as `tabfm finetune --preset long --max-minutes M`); flags given still override them.
Per run it records wall time, steps done, the stop reason, the best step, trainable parameters (counted
on the model, adapters only for LoRA), AdamW optimizer state bytes (computed: 2 fp32 tensors, exp_avg
and exp_avg_sq, per trainable parameter; the step counters not counted), and forgetting: the export's
in-context ROC-AUC on --forgetting-tables (other tables of the suite, their first-fold split too)
against the init's (ROC-AUC, or R^2 for regression).

Prints one markdown table per metric (rows = tables, columns = variants), a cost table and a summary
line, and writes JSON (default benchmarks/results/finetune_vs_context.json, with --task regression
finetune_vs_context_regression.json; --quick: the same stems ending _quick.json). Fine-tuning runs live under --work (default runs/finetune_vs_context,
git-ignored), restarted on every invocation. Single-threaded by design: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy / sklearn load their thread pools

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import machine_info  # noqa: E402
from tabfm.eval.metrics import classification_metrics  # noqa: E402
from tabfm.eval.metrics import regression_metrics  # noqa: E402
from tabfm.eval.protocols import _proba_in_code_order, classification_splits, regression_splits  # noqa: E402
from tabfm.eval.suites import default_public_dir, load_suite  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_TABLES = {"classification": "australian,german,anes96,titanic_survival",
                  "regression": "boston,concrete,carseats,cps1985"}
DEFAULT_FORGETTING = {"classification": "pbc,breast_cancer", "regression": "diabetes,auto"}
QUICK_TABLE = {"classification": "wine", "regression": "carseats"}
METRICS = {"classification": ("roc_auc", "log_loss", "accuracy"), "regression": ("r2", "rmse")}
# the default preset scaled to a budget of tens of steps (see the docstring)
SMALL_BUDGET = {"steps": 100_000, "eval_every": 10, "warmup_steps": 5, "patience": 4}
PRIMARY = {"classification": "roc_auc", "regression": "r2"}  # forgetting and wins/losses are counted on it
HIGHER = {"roc_auc": True, "log_loss": False, "accuracy": True, "r2": True, "rmse": False}
ADAMW_STATE_TENSORS = 2  # exp_avg, exp_avg_sq per parameter
FP32_BYTES = 4


# --------------------------------------------------------------------------- data: the suite's own loader and split

def protocol_fold(ds, task: str, fold: int = 0):
    """(X_train, y_train, X_test, y_test, K, train_idx, test_idx): fold `fold` of the public
    protocol of `task` (K, the class count, is None for regression)."""
    X = ds.X
    if task == "classification":
        y = ds.frame[ds.target].cat.codes.to_numpy().astype(np.int64)
        K = len(ds.frame[ds.target].cat.categories)
        tr, te = classification_splits(y)[fold]
    else:
        y = ds.frame[ds.target].to_numpy(dtype=np.float64)
        K = None
        tr, te = regression_splits(len(y))[fold]
    return (X.iloc[tr].reset_index(drop=True), y[tr], X.iloc[te].reset_index(drop=True), y[te], K, tr, te)


def score(model, params: dict, split, task: str) -> dict:
    """The protocol's metrics of TabFMClassifier / TabFMRegressor(model, **params) fitted on the
    train rows, on the test rows."""
    from tabfm.estimators import TabFMClassifier, TabFMRegressor

    Xtr, ytr, Xte, yte, K = split[:5]
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if task == "classification":
            est = TabFMClassifier(model=model, progress=False, **params).fit(Xtr, ytr)
            metrics = classification_metrics(yte, _proba_in_code_order(est, est.predict_proba(Xte), K), K)
        else:
            reg_params = {k: v for k, v in params.items() if k != "multiclass"}  # as HoldoutEval builds it
            est = TabFMRegressor(model=model, progress=False, **reg_params).fit(Xtr, ytr)
            metrics = regression_metrics(yte, est.predict(Xte))
    return {**metrics, "seconds": time.perf_counter() - t0}


def _line(s: dict, task: str) -> str:
    return " ".join(f"{m} {s[m]:.4f}" for m in METRICS[task])


# --------------------------------------------------------------------------- cost of a variant

def trainable_parameters(init: str, lora_rank: int | None, lora_alpha: float | None) -> dict:
    """Trainable / total parameters of the model fine-tuning trains (adapters only with LoRA),
    counted on the model itself, and the AdamW state bytes that follow from them."""
    from tabfm.model import TabFM
    from tabfm.model.lora import LoraConfig, add_adapters
    from tabfm.weights import load_model

    model = TabFM(load_model(init).config)  # a fresh copy: load_model's module is shared, never modify it
    if lora_rank is not None:
        add_adapters(model, LoraConfig(lora_rank, lora_alpha))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": int(trainable), "total_params": int(total),
            "optimizer_state_bytes": int(ADAMW_STATE_TENSORS * FP32_BYTES * trainable)}


# --------------------------------------------------------------------------- the benchmark

def run_fold(args, ds, fold: int, variants, spec, base_cfg, params, splits, forgetting, init_forget) -> dict:
    """In context and every fine-tuned variant on protocol fold `fold` of one table: {"info", "variants"}."""
    from tabfm.train.finetune import finetune

    task, primary = args.task, PRIMARY[args.task]
    split = protocol_fold(ds, task, fold)
    Xtr, ytr, Xte, yte, K, tr, te = split
    info = {"rows": int(len(ds.frame)), "features": int(len(ds.features)), "classes": K,
            "train_rows": int(len(tr)), "test_rows": int(len(te)), "fold": fold}
    row = {"info": info, "variants": {}}
    print(f"\n{ds.name} fold {fold}: {info}", flush=True)
    s = score(args.init, params, split, task)
    row["variants"]["in-context"] = {"test": s, "cost": {"wall_s": s["seconds"], "steps": 0,
                                                          **trainable_parameters(args.init, None, None),
                                                          "trainable_params": 0, "optimizer_state_bytes": 0}}
    print(f"  fold {fold} in-context: {_line(s, task)} ({s['seconds']:.0f} s)", flush=True)
    train_frame = ds.frame.iloc[tr].reset_index(drop=True)  # features + target, train rows only
    for variant in variants[1:]:
        rank, z, k = spec[variant]
        lr = args.lr if rank is None or args.lora_lr is None else args.lora_lr
        cfg = base_cfg.replace(target=ds.target, lora_rank=rank, lora_alpha=None, lr=lr, significance=z,
                               folds=k, max_minutes=args.minutes * k)  # each fold run: one run's budget
        out = Path(args.work) / f"seed{args.seed}" / ds.name / f"fold{fold}" / variant
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            res = finetune(cfg, out, data=train_frame, progress=False, restart=True)
        ft_wall = time.perf_counter() - t0
        export = res.export
        recorded = json.loads((export / "config.json").read_text())["finetune"]
        if recorded["estimator_params"] != params:
            print(f"  WARNING {variant}: export records estimator parameters {recorded['estimator_params']}, "
                  f"scored here with {params}", flush=True)
        s = score(str(export), recorded["estimator_params"], split, task)
        forget = {}
        for f in forgetting:
            if f == ds.name:
                continue
            fs = score(str(export), recorded["estimator_params"], splits[f], task)
            forget[f] = {"metric": primary, "value": fs[primary], "init_value": init_forget[f][primary],
                         "delta": fs[primary] - init_forget[f][primary], "seconds": fs["seconds"]}
        cost = {"lr": lr, "significance": z, "folds": k, "wall_s": ft_wall, "finetune_wall_s": res.wall_s, "steps": res.step, "stopped": res.stopped,
                "best_step": res.best_step, **trainable_parameters(args.init, rank, None),
                "holdout_before": res.initial.get("score"), "holdout_best": res.best.get("score"),
                "export_step": recorded.get("step")}
        row["variants"][variant] = {"test": s, "cost": cost, "forgetting": forget,
                                    "estimator_params": recorded["estimator_params"]}
        fdelta = " ".join(f"{f} {v['delta']:+.4f}" for f, v in forget.items())
        print(f"  fold {fold} {variant}: {_line(s, task)}; {res.step} steps ({res.stopped}), best step {res.best_step}, "
              f"{ft_wall / 60:.1f} min; forgetting Δ{primary} {fdelta}", flush=True)
    return row


def merge_folds(folds_out: list[dict], variants, task: str) -> dict:
    """One table's result over its protocol folds: each variant's test metrics are the mean over the
    folds (as `tabfm eval` reports a table), its cost that of the first fold; `folds` keeps every fold."""
    if len(folds_out) == 1:
        return folds_out[0]
    first = folds_out[0]
    info = {**first["info"], "fold": [r["info"]["fold"] for r in folds_out],
            "test_rows": sum(r["info"]["test_rows"] for r in folds_out)}
    merged = {"info": info, "variants": {}, "folds": folds_out}
    for v in variants:
        runs = [r["variants"][v] for r in folds_out]
        test = {m: float(np.mean([r["test"][m] for r in runs])) for m in runs[0]["test"]}
        merged["variants"][v] = {**runs[0], "test": test,
                                 "fold_wins": sum(r["test"][PRIMARY[task]] > f["variants"]["in-context"]["test"][PRIMARY[task]]
                                                  for r, f in zip(runs, folds_out))}
    return merged


def run(args) -> dict:
    from tabfm.train.finetune import FinetuneConfig, HoldoutEval
    from tabfm.weights import load_model

    torch.set_num_threads(1)
    task, primary = args.task, PRIMARY[args.task]
    if args.suite_dir:
        suite_dir = Path(args.suite_dir)
    else:
        suite_dir = default_public_dir() if task == "classification" else ROOT / "runs" / "regression-suite"
    tables = [t for t in args.tables.split(",") if t]
    forgetting = [t for t in args.forgetting_tables.split(",") if t]
    ranks = [int(r) for r in args.lora_ranks.split(",") if r] if args.lora_ranks else []
    datasets = {d.name: d for d in load_suite(suite_dir, task, sorted(set(tables) | set(forgetting)))}
    splits = {name: protocol_fold(ds, task) for name, ds in datasets.items()}  # forgetting: the first fold
    pfolds = [int(f) for f in args.protocol_folds.split(",")]

    # the preset's settings where a flag is not given; the default preset with this benchmark's
    # small-budget settings (SMALL_BUDGET), the ones every earlier table of BENCHMARKS.md ran with
    given = {"steps": args.steps, "eval_every": args.eval_every, "warmup_steps": args.warmup_steps,
             "patience": args.patience, "max_rows": args.max_rows, "eval_rows": args.eval_rows}
    if args.preset == "default":
        given = {k: SMALL_BUDGET.get(k) if v is None else v for k, v in given.items()}
    base_cfg = FinetuneConfig.preset(args.preset, init=args.init, task=task, max_minutes=args.minutes, threads=1,
                                     seed=args.seed, lr=args.lr, **{k: v for k, v in given.items() if v is not None})
    init_features = load_model(args.init).config.context_features
    params = HoldoutEval.params_for(base_cfg, init_features)  # what fine-tuning scores and exports with
    zs = [float(z) for z in args.significance.split(",")] if args.significance else [base_cfg.significance]
    folds = [int(k) for k in args.folds.split(",")]
    # variant -> (LoRA rank or None, significance of the step selection, folds); "-zZ" only when several
    # significances are compared, "-kK" for K-fold cross-fitting
    spec = {(f"{name}-z{z:g}" if len(zs) > 1 else name) + (f"-k{k}" if k > 1 else ""): (rank, z, k)
            for rank, name in [(None, "full")] + [(r, f"lora-{r}") for r in ranks] for z in zs for k in folds}
    variants = ["in-context", *spec]
    print(f"init {args.init} (context features {init_features}); estimator parameters {params}", flush=True)
    print(f"tables {tables}; forgetting tables {forgetting}; variants {variants}; budget {args.minutes} min per run",
          flush=True)

    t_start = time.perf_counter()
    init_forget = {}
    for f in forgetting:
        init_forget[f] = score(args.init, params, splits[f], task)
        print(f"  init in context on {f}: {_line(init_forget[f], task)} ({init_forget[f]['seconds']:.0f} s)", flush=True)

    results: dict = {}
    for name in tables:
        ds = datasets[name]
        folds_out = [run_fold(args, ds, fold, variants, spec, base_cfg, params, splits, forgetting, init_forget)
                     for fold in pfolds]
        results[name] = merge_folds(folds_out, variants, task)

    record = {
        "benchmark": "finetune_vs_context", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "task": task, "primary_metric": primary, "suite_dir": str(suite_dir),
        "split": ("classification_splits(y): StratifiedKFold(5, shuffle, seed 0)" if task == "classification"
                  else "regression_splits(n): KFold(5, shuffle, seed 0)"),
        "protocol_folds": pfolds,
        "init": args.init, "init_context_features": init_features, "estimator_params": params,
        "minutes_per_run": args.minutes, "steps_cap": base_cfg.steps, "lr": args.lr, "lora_lr": args.lora_lr or args.lr,
        "seed": args.seed,
        "finetune_config": base_cfg.to_dict(), "variants": variants, "tables": tables,
        "forgetting_tables": forgetting, "init_forgetting": init_forget,
        "optimizer_state_note": "computed, not measured: AdamW keeps 2 fp32 tensors (exp_avg, exp_avg_sq) per "
                                "trainable parameter; 8 bytes x trainable parameters",
        "results": results, "total_wall_s": time.perf_counter() - t_start,
    }
    return record


# --------------------------------------------------------------------------- report

def _fmt(v, digits: int = 4) -> str:
    return "–" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v:.{digits}f}"


def report(record: dict) -> str:
    variants, results = record["variants"], record["results"]
    task = record.get("task", "classification")
    primary = PRIMARY[task]
    lines = []
    for metric in METRICS[task]:
        arrow = "higher is better" if HIGHER[metric] else "lower is better"
        lines += [f"\n{metric} on the test rows ({arrow})\n", "| table | " + " | ".join(variants) + " |",
                  "|---|" + "---:|" * len(variants)]
        for name, row in results.items():
            vals = [row["variants"][v]["test"][metric] for v in variants]
            best = (max if HIGHER[metric] else min)(vals)
            cells = [f"**{_fmt(x)}**" if x == best else _fmt(x) for x in vals]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        means = [float(np.mean([row["variants"][v]["test"][metric] for row in results.values()])) for v in variants]
        lines.append("| mean | " + " | ".join(_fmt(m) for m in means) + " |")

    forget = record["forgetting_tables"]
    lines += [f"\ncost per run and forgetting (Δ{primary} of the export in context on the other tables vs the init's)\n",
              "| table | variant | wall min | steps | stopped | best step | trainable params | AdamW state |"
              + "".join(f" Δ {f} |" for f in forget),
              "|---|---|---:|---:|---|---:|---:|---:|" + "---:|" * len(forget)]
    for name, table in results.items():
        for row in table.get("folds", [table]):
            for v in variants[1:]:
                c, fg = row["variants"][v]["cost"], row["variants"][v]["forgetting"]
                lines.append(f"| {name} fold {row['info'].get('fold', 0)} | {v} | {c['wall_s'] / 60:.1f} | {c['steps']} | {c['stopped']} | {c['best_step']} | "
                             f"{c['trainable_params']:,} | {c['optimizer_state_bytes'] / 2**20:.2f} MiB |"
                             + "".join(f" {_fmt(fg[f]['delta'], 4) if f in fg else '–'} |" for f in forget))
    init_f = ", ".join(f"{f} {record['init_forgetting'][f][primary]:.4f}" for f in forget)
    lines.append(f"\ninit in context on the forgetting tables: {init_f}")

    means = {v: float(np.mean([row["variants"][v]["test"][primary] for row in results.values()])) for v in variants}
    summary = f"summary: mean {primary} " + ", ".join(f"{v} {means[v]:.4f}" for v in variants)
    wins = []
    for v in variants[1:]:
        w = t = lo = 0
        for row in results.values():
            a, b = row["variants"][v]["test"][primary], row["variants"]["in-context"]["test"][primary]
            w, t, lo = w + (a > b), t + (a == b), lo + (a < b)
        runs = [r["variants"][v] for row in results.values() for r in row.get("folds", [row])]
        kept = sum(r["cost"]["best_step"] == 0 for r in runs)
        fold_wins = sum(row["variants"][v].get("fold_wins", 0) for row in results.values())
        extra = f", folds won {fold_wins}/{len(runs)}" if any("folds" in row for row in results.values()) else ""
        wins.append(f"{v} {w}/{t}/{lo} (best step 0, the init exported: {kept}/{len(runs)} runs{extra})")
    summary += f"; {primary} wins/ties/losses of fine-tuned over in-context: " + ", ".join(wins)
    summary += f"; total wall {record['total_wall_s'] / 60:.1f} min"
    lines.append(summary)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from tabfm.train.finetune import FinetuneConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=tuple(PRIMARY), default="classification",
                    help="classification (public suite) or regression (runs/regression-suite)")
    ap.add_argument("--tables", default=None, help=f"comma list of tables of the task's suite (default {DEFAULT_TABLES})")
    ap.add_argument("--forgetting-tables", default=None,
                    help=f"other tables the exports are scored on in context (default {DEFAULT_FORGETTING})")
    ap.add_argument("--minutes", type=float, default=None, help="wall budget per fine-tuning run (default 1.5; --quick 0.3)")
    ap.add_argument("--preset", choices=tuple(FinetuneConfig.PRESETS), default="default",
                    help="FinetuneConfig preset, as `tabfm finetune --preset` (default: the default preset with "
                         "this benchmark's small-budget settings; another preset: its own settings where the flags "
                         "below are not given)")
    ap.add_argument("--steps", type=int, default=None, help="step cap (default preset: 100,000, so the budget binds)")
    ap.add_argument("--lr", type=float, default=1e-4, help="fine-tuning learning rate (FinetuneConfig default)")
    ap.add_argument("--lora-lr", type=float, default=None, help="learning rate of the LoRA runs (default: --lr)")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="held-out evaluations every N steps (default preset: 10; FinetuneConfig: 25)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="linear warm-up steps (default preset: 5; FinetuneConfig: 20)")
    ap.add_argument("--max-rows", type=int, default=None, help="rows per training episode, at most "
                    "(FinetuneConfig: 512; the estimators' context reads up to 2,048)")
    ap.add_argument("--eval-rows", type=int, default=None, help="held-out rows scored per evaluation (FinetuneConfig: 2048)")
    ap.add_argument("--patience", type=int, default=None,
                    help="evaluations without improvement before stopping (default preset: 4)")
    ap.add_argument("--significance", default=None,
                    help="comma list of FinetuneConfig.significance values (paired standard errors an evaluation "
                         "must beat the best by to be exported); several: one variant each (default: the config's)")
    ap.add_argument("--folds", default="1",
                    help="comma list of FinetuneConfig.folds values: 1 is one run with a 20%% holdout; K >= 2 the "
                         "K-fold cross-fitted variant (named ...-kK), each of its K fold runs --minutes long")
    ap.add_argument("--protocol-folds", default="0",
                    help="comma list of the protocol's folds (0-4) to run each table on; several: a table's score is "
                         "the mean over them (as `tabfm eval` reports it) and every fold is kept in the JSON")
    ap.add_argument("--lora-ranks", default="8", help="comma list of LoRA ranks ('' for none); the issue: 4,8,16")
    ap.add_argument("--init", default="tabfm-tiny-cf", help="starting weights (shipped name or export directory)")
    ap.add_argument("--seed", type=int, default=0, help="fine-tuning seed (its holdout split, episodes) and the "
                                                         "estimators' random_state")
    ap.add_argument("--suite-dir", default=None, help="suite directory (default ~/.cache/tabfm/public_suites for "
                                                       "classification, runs/regression-suite for regression)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "finetune_vs_context"), help="fine-tuning run directories")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/finetune_vs_context.json)")
    ap.add_argument("--quick", action="store_true", help=f"smoke check: {QUICK_TABLE} only, 0.3 min per run")
    args = ap.parse_args(argv)
    if args.quick:
        args.tables = args.tables or QUICK_TABLE[args.task]
        args.minutes = args.minutes or 0.3
    args.tables = args.tables or DEFAULT_TABLES[args.task]
    args.forgetting_tables = args.forgetting_tables if args.forgetting_tables is not None else DEFAULT_FORGETTING[args.task]
    args.minutes = args.minutes or 1.5
    overlap = set(args.tables.split(",")) & set(args.forgetting_tables.split(","))
    if overlap:
        print(f"note: {sorted(overlap)} are both fine-tuned and forgetting tables; a table's own forgetting "
              "score is skipped", flush=True)
    stem = "finetune_vs_context" + ("_regression" if args.task == "regression" else "")
    path = Path(args.json) if args.json else RESULTS / (stem + ("_quick.json" if args.quick else ".json"))
    record = run(args)
    text = report(record)
    record["report"] = text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=float))
    print(text)
    print(f"\nwrote {path}")
    return record


if __name__ == "__main__":
    main()
