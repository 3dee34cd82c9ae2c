"""One long table under row-sequence parallelism: activation memory per rank and step time at sp = 1, 2, 4,
and the longest table whose training step fits a fixed per-process activation budget.

    python benchmarks/long_context.py                 # 8,192 rows × 32 columns, sp = 1, 2, 4 (~10 min, 2 cores)
    python benchmarks/long_context.py --quick         # 1,024 rows × 8 columns, sp = 1, 2 (smoke, ~1 min)
    python benchmarks/long_context.py --rows 4096 --cols 16 --sp 1,2 --budget-mib 256 [--json out.json]

Launches itself: each sp runs in a fresh group of `sp` gloo processes (`tests/dist_utils.
run_distributed`: torchrun environment, one intra-op thread each), under
`HybridParallelPlugin(sp_size=sp)` — sp = 1 is the same plugin on one process, i.e. the
plain model. Every rank holds the whole table and trains on its contiguous slice of rows:
the model is `TabFM(d_model=32, 2 layers, 4 heads, MLP 64)`, fp32, AdamW, one table whose
rows are 50 % context rows scattered at random (as the synthetic prior draws them),
queries = the target column of the other rows.

Per rank, for one training step (forward, `masked_cell_loss`, `booster.backward`, AdamW step):

- saved activations  bytes of every distinct storage autograd saves for backward during the
                     forward (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded:
                     the activation memory the step holds when backward starts. Deterministic.
- peak RSS rise      `ru_maxrss` after the step minus the RSS just before it: the same plus
                     transient buffers (attention workspaces, gradients, optimizer state on the
                     first step) and allocator slack.
- step s / cpu s     wall-clock and process CPU seconds of the step. This machine has 2 cores,
                     so sp = 4 oversubscribes them and its wall time says little; CPU seconds
                     per rank show the per-rank work.

Expectation: everything per row shrinks as 1/sp, except the all-gathered keys and values of
row attention (every rank attends to all context rows, and SDPA saves the gathered K/V for
backward), so saved activations ≈ a / sp + b with b the K/V of the context rows.

Longest table within the budget (`--budget-mib`, saved activations per rank): the saved bytes
are linear in rows at a fixed sp (SDPA's CPU flash kernel keeps no score matrix), so each sp
is measured with a forward at two sizes, the line gives the largest row count under the
budget (a multiple of 64 × sp), and one more forward at that size checks it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchmarks.common import machine_info  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "long_context.json"
MODEL = dict(d_model=32, n_layers=2, n_heads=4, mlp_ratio=2.0, n_bins=32, id_dim=16, n_thinking_rows=0)
FULL = dict(rows=8192, cols=32, sp=(1, 2, 4), budget_mib=512, fit_rows=2048)
QUICK = dict(rows=1024, cols=8, sp=(1, 2), budget_mib=32, fit_rows=512)
CONTEXT_FRACTION = 0.5
MIB = 1024 ** 2


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_table(rows: int, cols: int, seed: int = 0):
    """One table: Gaussian numeric columns, ~25 % categorical (5 codes), categorical target in
    the last column; context rows drawn at random (CONTEXT_FRACTION); queries = the target of
    the other rows."""
    from tabfm.data.batch import TableBatch

    g = torch.Generator().manual_seed(seed)
    kind = torch.where(torch.rand(1, cols, generator=g) < 0.25, 2, 1).to(torch.int8)
    kind[:, -1] = 2
    card = torch.where(kind == 2, 5, 0).long()
    x = torch.randn(1, rows, cols, generator=g)
    x = torch.where(kind[:, None, :] == 2, torch.randint(0, 5, (1, rows, cols), generator=g).float(), x)
    ctx = torch.rand(1, rows, generator=g) < CONTEXT_FRACTION
    ctx[:, 0] = True
    query = torch.zeros(1, rows, cols, dtype=torch.bool)
    query[:, :, -1] = ~ctx
    ones_r, ones_c = torch.ones(1, rows, dtype=torch.bool), torch.ones(1, cols, dtype=torch.bool)
    return TableBatch(x, kind, card, ones_r, ones_c, ctx, query).validate()


class SavedBytes:
    """Distinct storages autograd saves for backward (parameters excluded)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def worker(rank: int, world_size: int, rows: int, cols: int, full_step: bool, seed: int) -> dict[str, Any]:
    """One rank: boost, then a training step (or only its forward); measure."""
    from tabfm.parallel import Booster, HybridParallelPlugin
    from tabfm.model import ModelConfig, TabFM, masked_cell_loss

    booster = Booster(HybridParallelPlugin(sp_size=world_size))
    torch.manual_seed(seed)
    module = TabFM(ModelConfig(**MODEL))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01)
    model, opt, crit, _, _ = booster.boost(module, opt, masked_cell_loss)
    model.train()
    batch = make_table(rows, cols, seed)
    saved = SavedBytes(module)
    rss0, t0, c0 = current_rss(), time.perf_counter(), time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss, metrics = crit(model(batch), batch)
    forward_s = time.perf_counter() - t0
    if full_step:
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
    return {"rank": rank, "saved_bytes": saved.total, "rss_rise_bytes": peak_rss() - rss0,
            "step_s": time.perf_counter() - t0, "forward_s": forward_s, "cpu_s": time.process_time() - c0,
            "loss": float(loss.detach()), "full_step": full_step, "n_params": module.num_parameters()}


def run(sp: int, rows: int, cols: int, full_step: bool, seed: int, timeout: float) -> list[dict[str, Any]]:
    from tests.dist_utils import run_distributed

    return run_distributed(worker, world_size=sp, args=(rows, cols, full_step, seed), timeout_s=timeout,
                           pg_timeout_s=timeout)


def summary(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The largest rank's figures."""
    return {k: max(r[k] for r in per_rank) for k in ("saved_bytes", "rss_rise_bytes", "step_s", "forward_s", "cpu_s")}


def longest_within(budget: int, sp: int, cols: int, points: list[tuple[int, int]], seed: int, timeout: float,
                   log) -> dict[str, Any]:
    """Rows at which the saved activations per rank reach `budget` (the line through `points`,
    (rows, bytes)), rounded down to a multiple of 64 × sp, checked by one forward there."""
    (r1, b1), (r2, b2) = points
    slope = (b2 - b1) / (r2 - r1)
    intercept = b1 - slope * r1
    unit = 64 * sp
    predicted = max(unit, int((budget - intercept) / slope) // unit * unit)
    for _ in range(3):
        measured = summary(run(sp, predicted, cols, False, seed, timeout))["saved_bytes"]
        log(f"  sp={sp}: {predicted} rows -> {measured / MIB:.0f} MiB saved per rank (budget {budget / MIB:.0f})")
        if measured <= budget:
            break
        predicted = max(unit, int(predicted * budget / measured) // unit * unit)
    return {"sp": sp, "rows": predicted, "saved_bytes": measured, "within_budget": measured <= budget,
            "fit_bytes_per_row": slope, "fit_intercept_bytes": intercept}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    ap.add_argument("--rows", type=int, default=None, help=f"rows of the table (default {FULL['rows']})")
    ap.add_argument("--cols", type=int, default=None, help=f"columns (default {FULL['cols']})")
    ap.add_argument("--sp", default=None, help="comma-separated sp sizes (default 1,2,4)")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help=f"saved activations per rank for the longest-table search (default "
                         f"{FULL['budget_mib']}; 0 skips it)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None,
                    help=f"output JSON (default {DEFAULT_JSON.relative_to(ROOT)}; not written with --quick unless given)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    base = QUICK if args.quick else FULL
    rows = args.rows or base["rows"]
    cols = args.cols or base["cols"]
    sps = [int(s) for s in args.sp.split(",")] if args.sp else list(base["sp"])
    budget_mib = base["budget_mib"] if args.budget_mib is None else args.budget_mib
    fit_rows = min(base["fit_rows"], rows // 2)
    for sp in sps:
        if rows % sp or fit_rows % sp:
            raise SystemExit(f"--rows {rows} (and the fit size {fit_rows}) must be divisible by every sp, got sp={sp}")

    def log(msg: str) -> None:
        print(f"[long_context] {msg}", file=sys.stderr, flush=True)

    started, load_start = time.time(), os.getloadavg()
    results = []
    for sp in sps:
        per_rank = run(sp, rows, cols, True, args.seed, args.timeout)
        s = summary(per_rank)
        results.append({"sp": sp, "rows": rows, "cols": cols, "per_rank": per_rank, **s})
        log(f"sp={sp}: {rows}x{cols}: saved {s['saved_bytes'] / MIB:.0f} MiB, "
            f"RSS rise {s['rss_rise_bytes'] / MIB:.0f} MiB, step {s['step_s']:.1f} s, cpu {s['cpu_s']:.1f} s, "
            f"loss {per_rank[0]['loss']:.4f}")
    base_saved = results[0]["saved_bytes"]
    longest = []
    if budget_mib > 0:
        log(f"longest table within {budget_mib:.0f} MiB of saved activations per rank")
        for r in results:
            small = summary(run(r["sp"], fit_rows, cols, False, args.seed, args.timeout))["saved_bytes"]
            points = [(fit_rows, small), (rows, r["saved_bytes"])]
            longest.append(longest_within(int(budget_mib * MIB), r["sp"], cols, points, args.seed, args.timeout, log))

    print(f"\nOne table of {rows:,} rows × {cols} columns ({CONTEXT_FRACTION:.0%} context rows, scattered), "
          f"TabFM {MODEL}, fp32, one training step; largest rank shown.\n")
    print("| sp | rows per rank | saved activations / rank (MiB) | vs sp=1 | peak RSS rise / rank (MiB) | step (s) "
          "| CPU s / rank |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['sp']} | {rows // r['sp']:,} | {r['saved_bytes'] / MIB:.0f} | "
              f"{r['saved_bytes'] / base_saved:.2f} | {r['rss_rise_bytes'] / MIB:.0f} | {r['step_s']:.1f} | "
              f"{r['cpu_s']:.1f} |")
    if longest:
        print(f"\nLongest table within {budget_mib:.0f} MiB of saved activations per process ({cols} columns):\n")
        print("| sp | rows | saved / rank (MiB) | vs sp=1 | fit: KiB per row |")
        print("|---:|---:|---:|---:|---:|")
        for entry in longest:
            print(f"| {entry['sp']} | {entry['rows']:,} | {entry['saved_bytes'] / MIB:.0f} | "
                  f"{entry['rows'] / longest[0]['rows']:.2f} | {entry['fit_bytes_per_row'] / 1024:.1f} |")
    load_end = os.getloadavg()
    print(f"\nload average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; {time.time() - started:.0f} s")

    machine = machine_info()
    machine.update(load_average_start=list(load_start), load_average_end=list(load_end))
    out = {
        "benchmark": "long_context",
        "command": " ".join([Path(sys.executable).name, "benchmarks/long_context.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "created_unix": started,
        "duration_s": time.time() - started,
        "machine": machine,
        "settings": {"model_config": MODEL, "n_params": results[0]["per_rank"][0]["n_params"], "rows": rows,
                     "cols": cols, "context_fraction": CONTEXT_FRACTION, "precision": "fp32",
                     "optimizer": "AdamW(lr=1e-4, weight_decay=0.01)", "plugin": "HybridParallelPlugin(sp_size=sp)",
                     "budget_mib": budget_mib, "fit_rows": fit_rows,
                     "saved_bytes": "distinct storages saved for backward during the forward, parameters excluded"},
        "results": results,
        "longest_within_budget": longest,
    }
    path = Path(args.json) if args.json else (None if args.quick else DEFAULT_JSON)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        log(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
