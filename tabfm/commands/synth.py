"""`tabfm synth`: summarise a stretch of the synthetic stream, or write a synthetic corpus to a store.

Without --out: a first look at what the model trains on (sizes and shape buckets, the episode
mix, classes, missing and categorical rates, and how fast the prior runs).

With --out DIR --tables N: a pre-generated corpus of N raw tables (DataFrames with datetimes,
text, strings, booleans; tabfm.synth.raw) written to the table store DIR (tabfm.data.store), one
`synth-00000000.parquet` ... per table with a header naming its target and task. Table i is
table 0 of stream position i in raw mode (`SynthStream(cfg, seed).frames_at(i)[0][0]`), a pure
function of (config, seed, i), so the corpus does not depend on --workers. Reruns resume: a table
whose file is complete (written atomically, header readable, same seed and config) is skipped,
temporaries of a killed run are removed; a store written with another seed or config is refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tabfm.commands._common import STREAM_PRESETS, add_output_flags, add_preset, show_progress

DEFAULT_BATCHES = 24
CORPUS_SOURCE = "tabfm synth"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "synth",
        help="generate and summarise the synthetic-table stream, or write a synthetic corpus",
        description="Generate batches of the seeded synthetic-table stream and print a summary; with "
                    "--out DIR --tables N, write N raw synthetic tables to the table store DIR (resumable).",
    )
    p.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    p.add_argument("--batches", type=int, default=None, help=f"batches to generate (default {DEFAULT_BATCHES})")
    p.add_argument("--out", metavar="DIR", help="write a corpus of raw tables to this table store (with --tables)")
    p.add_argument("--tables", type=int, help="tables in the corpus written to --out (resumes what is there)")
    add_preset(p, STREAM_PRESETS, "default", "StreamConfig preset of the stream")
    p.add_argument("--rows", metavar="MIN:MAX", help="rows per table (overrides the preset)")
    p.add_argument("--cols", metavar="MIN:MAX", help="columns per table, target included (overrides the preset)")
    p.add_argument("--max-cells", type=int, help="cap on rows x columns of one table")
    p.add_argument("--cells-per-batch", type=int, help="cells per batch (sets the batch size of each shape)")
    p.add_argument("--mix", metavar="C,R,I", help="episode mix: classification,regression,imputation weights")
    p.add_argument("--rank", type=int, default=0, help="data-parallel rank to generate for (default 0)")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel world size (default 1)")
    p.add_argument("--workers", type=int, default=0,
                   help="worker processes: DataLoader workers, or corpus writers with --out (default 0: main process)")
    p.add_argument("--raw", action="store_true", help="generate raw pandas DataFrames (dates, text, ...) instead of tensors")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    add_output_flags(p)
    return p


# ------------------------------------------------------------------ config
def _range(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} expects MIN:MAX integers, got {text!r}") from None
    return lo, hi


def build_config(args: argparse.Namespace):
    """The StreamConfig the flags describe: preset, then overrides, sizes made to fit each other."""
    from tabfm.synth.stream import StreamConfig

    cfg = StreamConfig.preset(args.preset)
    changes: dict[str, Any] = {}
    if args.rows:
        changes["min_rows"], changes["max_rows"] = _range(args.rows, "--rows")
    if args.cols:
        changes["min_cols"], changes["max_cols"] = _range(args.cols, "--cols")
    if args.mix:
        try:
            weights = [float(v) for v in args.mix.split(",")]
        except ValueError:
            weights = []
        if len(weights) != 3:
            raise ValueError(f"--mix expects three comma-separated weights C,R,I, got {args.mix!r}")
        changes["classification"], changes["regression"], changes["imputation"] = weights
    if args.rows or args.cols:
        # keep the preset's bucketing where it fits, loosen it where the new sizes need it
        lo_r, hi_r = changes.get("min_rows", cfg.min_rows), changes.get("max_rows", cfg.max_rows)
        lo_c = changes.get("min_cols", cfg.min_cols)
        q = cfg.row_quantum
        while q > 1 and -(-lo_r // q) * q > hi_r:
            q //= 2
        changes["row_quantum"] = max(q, 1)
        lo_q = -(-lo_r // changes["row_quantum"]) * changes["row_quantum"]
        if args.max_cells is None:
            changes["max_cells"] = max(cfg.max_cells, lo_q * lo_c)
    if args.max_cells is not None:
        changes["max_cells"] = args.max_cells
    if args.cells_per_batch is not None:
        changes["cells_per_batch"] = args.cells_per_batch
    elif "max_cells" in changes:
        changes["cells_per_batch"] = max(cfg.cells_per_batch, changes["max_cells"])
    return cfg.replace(**changes) if changes else cfg


# ----------------------------------------------------------------- summary
class Summary:
    """Accumulates what the stream produced; `to_dict()` is the JSON, `render()` the table."""

    def __init__(self, cfg, seed: int, raw: bool):
        self.cfg, self.seed, self.raw = cfg, seed, raw
        self.batches = self.tables = self.cells = self.missing = self.query = 0
        self.columns = self.categorical = 0
        self.shapes: Counter = Counter()  # (rows, cols) -> tables
        self.tasks: Counter = Counter()
        self.classes: Counter = Counter()
        self.dtypes: Counter = Counter()
        self.seconds = 0.0

    def add_batch(self, batch, info) -> None:
        from tabfm.data.batch import CATEGORICAL

        b, r, c = batch.shape
        valid = batch.row_valid[:, :, None] & batch.col_valid[:, None, :]
        self._add_common(info, b, r, c)
        self.cells += int(valid.sum())
        self.missing += int((batch.x.isnan() & valid).sum())
        self.query += int(batch.query.sum())
        self.columns += int(batch.col_valid.sum())
        self.categorical += int((batch.kind == CATEGORICAL).sum())

    def add_frames(self, frames, info) -> None:
        r = max(len(f) for f in frames)
        c = max(f.shape[1] for f in frames)
        self._add_common(info, len(frames), r, c)
        for f in frames:
            self.cells += int(f.size)
            self.missing += int(f.isna().to_numpy().sum())
            self.columns += f.shape[1]
            for dtype in f.dtypes:
                name = _dtype_name(dtype)
                self.dtypes[name] += 1
                self.categorical += name in ("category", "text", "bool")

    def _add_common(self, info, b: int, r: int, c: int) -> None:
        self.batches += 1
        self.tables += b
        self.shapes[(r, c)] += b
        self.tasks.update(info.tasks)
        self.classes.update(k for k in info.n_classes if k)

    def to_dict(self) -> dict[str, Any]:
        secs = max(self.seconds, 1e-9)
        mix = self.cfg.mix
        d: dict[str, Any] = {
            "seed": self.seed,
            "raw": self.raw,
            "batches": self.batches,
            "tables": self.tables,
            "cells": self.cells,
            "distinct_shapes": len(self.shapes),
            "rows_histogram": _histogram({r: n for (r, _), n in self.shapes.items()}, *self.cfg.row_range),
            "cols_histogram": _histogram({c: n for (_, c), n in self.shapes.items()}, self.cfg.min_cols, self.cfg.max_cols),
            "tasks": {t: {"tables": self.tasks[t], "fraction": self.tasks[t] / max(self.tables, 1), "configured": mix[t]} for t in mix},
            "classes": {str(k): self.classes[k] for k in sorted(self.classes)},
            "missing_rate": self.missing / max(self.cells, 1),
            "categorical_fraction": self.categorical / max(self.columns, 1),
            "seconds": self.seconds,
            "tables_per_s": self.tables / secs,
            "cells_per_s": self.cells / secs,
        }
        if self.raw:
            d["dtypes"] = dict(self.dtypes.most_common())
        else:
            d["query_fraction"] = self.query / max(self.cells, 1)
        return d

    def render(self) -> str:
        d = self.to_dict()
        out = [
            f"tabfm synth  seed={d['seed']}  preset rows {self.cfg.min_rows}:{self.cfg.max_rows}  "
            f"cols {self.cfg.min_cols}:{self.cfg.max_cols}  max_cells {self.cfg.max_cells}  "
            f"cells/batch {self.cfg.cells_per_batch}{'  (raw DataFrames)' if self.raw else ''}",
            "",
            f"  batches {d['batches']:>10,}      tables/s {d['tables_per_s']:>12,.1f}",
            f"  tables  {d['tables']:>10,}      cells/s  {d['cells_per_s']:>12,.0f}",
            f"  cells   {d['cells']:>10,}      seconds  {d['seconds']:>12.2f}",
            f"  missing rate {d['missing_rate']:.3f}   categorical columns {d['categorical_fraction']:.3f}"
            + ("" if self.raw else f"   query cells {d['query_fraction']:.3f}"),
            "",
            f"  episode mix      tables  fraction  configured",
        ]
        for t, v in d["tasks"].items():
            out.append(f"  {t:<15} {v['tables']:>7,}  {v['fraction']:>8.3f}  {v['configured']:>10.3f}")
        for title, hist in (("rows", d["rows_histogram"]), ("cols", d["cols_histogram"])):
            out += ["", f"  {title:<15} tables   ({d['distinct_shapes']} distinct shapes)" if title == "rows" else f"  {title:<15} tables"]
            top = max((n for _, n in hist), default=0) or 1
            for label, n in hist:
                out.append(f"  {label:<15} {n:>7,}  {'#' * round(30 * n / top)}")
        if d["classes"]:
            out += ["", "  classes         tables"]
            top = max(d["classes"].values())
            out += [f"  {k:<15} {n:>7,}  {'#' * round(30 * n / top)}" for k, n in d["classes"].items()]
        if self.raw:
            out += ["", "  dtype           columns"] + [f"  {k:<15} {n:>7,}" for k, n in d["dtypes"].items()]
        return "\n".join(out)


def _histogram(counts: dict[int, int], lo: int, hi: int, bins: int = 8) -> list[tuple[str, int]]:
    """Counts of values in `bins` equal ranges covering [lo, hi]: [(label, count)]."""
    width = max(1, math.ceil((hi - lo + 1) / bins))
    edges = list(range(lo, hi + 1, width))
    hist = [0] * len(edges)
    for v, n in counts.items():
        hist[min((v - lo) // width, len(edges) - 1)] += n
    return [(f"{e}-{min(e + width - 1, hi)}", n) for e, n in zip(edges, hist)]


def _dtype_name(dtype) -> str:
    kind = getattr(dtype, "kind", "O")
    if str(dtype) == "category":
        return "category"
    return {"f": "float", "i": "int", "u": "int", "b": "bool", "M": "datetime", "m": "timedelta"}.get(kind, "text")


# --------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if args.out is not None or args.tables is not None:
        return run_corpus(args)
    return run_summary(args)


def run_summary(args: argparse.Namespace) -> int:
    """Generate --batches batches of the stream and print (and optionally save) the summary."""
    from tqdm import tqdm

    from tabfm.synth.dataset import SynthDataset, SynthLoader

    args.batches = DEFAULT_BATCHES if args.batches is None else args.batches
    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    cfg = build_config(args)
    mode = "frames" if args.raw else "episode"
    ds = SynthDataset(cfg, seed=args.seed, rank=args.rank, world_size=args.world_size, num_batches=args.batches, mode=mode)
    loader = SynthLoader(ds, num_workers=args.workers)
    summary = Summary(cfg, args.seed, args.raw)
    bar = tqdm(total=args.batches, unit="batch", file=sys.stderr, disable=not show_progress(args), dynamic_ncols=True)
    start = time.perf_counter()
    for data, info in loader:
        if args.raw:
            summary.add_frames(data, info)
        else:
            summary.add_batch(data, info)
        summary.seconds = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(tables=summary.tables, cells_s=f"{summary.cells / max(summary.seconds, 1e-9):,.0f}")
    bar.close()
    print(summary.render())
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
        if not args.quiet:
            print(f"\nwrote {path}")
    return 0


# ------------------------------------------------------------------ corpus (--out)
def table_name(index: int) -> str:
    """Store name of corpus table `index` (zero-padded so names sort by index)."""
    return f"synth-{index:08d}"


def config_fingerprint(cfg: Any) -> str:
    """A short hash of the whole StreamConfig (prior included): a resumed corpus must match it."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def corpus_table(cfg: Any, seed: int, index: int) -> tuple[Any, str | None, str, int]:
    """Corpus table `index`: (frame, target, task, n_classes), a pure function of (cfg, seed, index).

    It is table 0 of stream position `index` rendered as a raw DataFrame, i.e.
    `SynthStream(cfg, seed).frames_at(index)[0][0]`, without generating the rest of that batch.
    Imputation episodes have no target column (target None, task "imputation").
    """
    from tabfm.synth.episodes import IMPUTATION
    from tabfm.synth.raw import TARGET, to_frame
    from tabfm.synth.stream import _RAW, SynthStream, table_rng
    from tabfm.synth.table import CLASSIFICATION

    table, episode = SynthStream(cfg, seed=seed).table(index, 0)
    frame = to_frame(table, table_rng(seed, index, 0, 0, _RAW), cfg.prior)
    target = None if episode.task == IMPUTATION else TARGET
    n_classes = int(table.cardinality[table.target]) if episode.task == CLASSIFICATION else 0
    return frame, target, episode.task, n_classes


def _write_corpus_table(job: tuple) -> dict[str, Any]:
    """Generate and write one corpus table (runs in a worker process); returns its stats."""
    from tabfm.data.store import write_table

    cfg, seed, out, index, fingerprint = job
    frame, target, task, n_classes = corpus_table(cfg, seed, index)
    h = write_table(out, table_name(index), frame, target=target, task=task, source=CORPUS_SOURCE,
                    seed=seed, index=index, config=fingerprint, n_classes=n_classes)
    return {"index": index, "rows": h.n_rows, "cols": h.n_cols, "bytes": h.path.stat().st_size, "task": task}


def _complete_table(out: Path, index: int, seed: int, fingerprint: str) -> dict[str, Any] | None:
    """Stats of corpus table `index` when its file is complete and from this corpus; None to (re)generate."""
    from tabfm.data.store import SUFFIX, read_header

    path = out / f"{table_name(index)}{SUFFIX}"
    if not path.exists():
        return None
    try:
        h = read_header(path)
    except ValueError as err:  # damaged after it was written: make it again
        print(f"tabfm synth: {err}; regenerating it", file=sys.stderr)
        path.unlink()
        return None
    e = h.extra
    if (e.get("source"), e.get("seed"), e.get("config"), e.get("index")) != (CORPUS_SOURCE, seed, fingerprint, index):
        raise ValueError(f"{path} belongs to another corpus (source {e.get('source')!r}, seed {e.get('seed')!r}, "
                         f"config {e.get('config')!r}); this run has seed {seed}, config {fingerprint}: "
                         "rerun with the same flags, or use a new --out")
    return {"index": index, "rows": h.n_rows, "cols": h.n_cols, "bytes": path.stat().st_size, "task": h.task}


def _check_corpus_args(args: argparse.Namespace) -> None:
    if args.out is None or args.tables is None:
        raise ValueError("--out DIR and --tables N go together (write N tables to the store DIR)")
    if args.tables < 1:
        raise ValueError(f"--tables must be >= 1, got {args.tables}")
    if args.batches is not None:
        raise ValueError("--batches does not apply with --out; use --tables")
    if args.rank != 0 or args.world_size != 1:
        raise ValueError("--rank / --world-size do not apply with --out: a corpus is one set of tables for every rank")


def run_corpus(args: argparse.Namespace) -> int:
    """Write (or complete) a corpus of --tables raw synthetic tables into the store --out."""
    from tqdm import tqdm

    from tabfm.data.store import clean_temp_files
    from tabfm.synth.stream import SynthStream

    _check_corpus_args(args)
    cfg = build_config(args)
    SynthStream(cfg, seed=args.seed)  # validates the seed here, not in a worker
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    clean_temp_files(out)  # leftovers of a killed run
    fingerprint = config_fingerprint(cfg)
    stats: dict[int, dict[str, Any]] = {}
    for i in range(args.tables):
        done = _complete_table(out, i, args.seed, fingerprint)
        if done is not None:
            stats[i] = done
    skipped = len(stats)
    jobs = [(cfg, args.seed, str(out), i, fingerprint) for i in range(args.tables) if i not in stats]
    workers = min(args.workers, len(jobs))
    pool = None
    if workers > 1:  # fork where the OS has it (no re-import of torch/pandas per worker), as DataLoader does
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = multiprocessing.get_context(method).Pool(workers)
    bar = tqdm(total=args.tables, initial=skipped, unit="table", file=sys.stderr, disable=not show_progress(args),
               dynamic_ncols=True)
    try:
        results = map(_write_corpus_table, jobs) if pool is None else pool.imap_unordered(_write_corpus_table, jobs)
        for r in results:
            stats[r["index"]] = r
            bar.update(1)
    finally:  # on error or Ctrl-C, stop the workers; their temporaries are removed by the next run
        if pool is not None:
            pool.terminate()
            pool.join()
        bar.close()
    summary = corpus_summary(out, args.seed, fingerprint, stats, skipped, max(args.workers, 1), time.perf_counter() - start)
    print(render_corpus_summary(summary))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        if not args.quiet:
            print(f"\nwrote {path}")
    return 0


def corpus_summary(out: Path, seed: int, fingerprint: str, stats: dict[int, dict[str, Any]], skipped: int,
                   workers: int, seconds: float) -> dict[str, Any]:
    """What the store holds after a corpus run (all its tables) and what this run did."""
    written = len(stats) - skipped
    tasks = Counter(r["task"] for r in stats.values())
    return {
        "out": str(out), "seed": seed, "config": fingerprint, "tables": len(stats), "written": written,
        "skipped": skipped, "rows": sum(r["rows"] for r in stats.values()),
        "cells": sum(r["rows"] * r["cols"] for r in stats.values()), "bytes": sum(r["bytes"] for r in stats.values()),
        "tasks": dict(sorted(tasks.items())), "workers": workers, "seconds": seconds,
        "tables_per_s": written / max(seconds, 1e-9),
    }


def render_corpus_summary(d: dict[str, Any]) -> str:
    mb = d["bytes"] / 2**20
    return "\n".join([
        f"tabfm synth --out {d['out']}  seed={d['seed']}  config {d['config']}",
        "",
        f"  tables  {d['tables']:>12,}      written  {d['written']:>10,}   skipped {d['skipped']:,} (complete)",
        f"  rows    {d['rows']:>12,}      seconds  {d['seconds']:>10.2f}   workers {d['workers']}",
        f"  cells   {d['cells']:>12,}      tables/s {d['tables_per_s']:>10.1f}",
        f"  bytes   {d['bytes']:>12,}      ({mb:,.1f} MiB)",
        "  tasks   " + "  ".join(f"{t} {n:,}" for t, n in d["tasks"].items()),
    ])
