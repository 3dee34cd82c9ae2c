"""Per-rank memory of the data-parallel plugins: parameters, gradients, optimizer state, peak RSS.

    python benchmarks/engine_memory.py                      # ddp, zero1, zero2, fsdp at 1, 2, 4 ranks
    python benchmarks/engine_memory.py --quick              # toy model and batch, 2 ranks (smoke, ~30 s)
    python benchmarks/engine_memory.py --plugins ddp,zero1 --world-sizes 2 [--json out.json]

Launches itself: for every (plugin, world size) it spawns a fresh group of gloo processes
(`torch.multiprocessing`, spawn; through `tests/dist_utils.run_distributed`, which gives each
process the torchrun environment and one intra-op thread and initialises the group with
`tabfm.parallel.launch.launch`), so each configuration's peak RSS is its own. No torchrun needed.

Each rank builds `TabFM(ModelConfig.preset("small"))` (2.05M parameters, same seed everywhere),
AdamW on its parameters, boosts both with the plugin (fp32), and runs ONE real training step
on its own synthetic batch (`masked_cell_loss`, `booster.backward`, `optimizer.step`). Then,
before `zero_grad`, it counts the bytes this rank holds:

- params   every parameter's local storage: a DTensor's `.to_local()` shard (FSDP2-based
           plugins), the full tensor otherwise;
- grads    the same for `.grad` (DTensor shards after a reduce-scatter; DDP's averaged full
           gradients otherwise). DDP's communication buckets (another full gradient copy unless
           `gradient_as_bucket_view`) are not counted;
- optim    the optimizer's state tensors (AdamW `exp_avg`, `exp_avg_sq`, `step`): for
           `ZeroRedundancyOptimizer` only its local partition (`.optim.state`), DTensor state
           as local shards;
- params in step  the most parameter bytes held at any module's forward during the step:
           the resting shards plus the parameters FSDP2 has all-gathered at that moment
           (sampled with forward pre-hooks on every module). ZeRO-2 keeps the whole model
           gathered from forward to backward, FSDP one block (and the root) at a time;
- peak RSS `ru_maxrss` of the process (its whole life: imports, model, step), and its rise
           over the RSS just before the model was built.

Ratios are against DDP at the same world size; the expectation is ZeRO-1 optim ≈ 1/N,
ZeRO-2 grads and optim ≈ 1/N, FSDP params, grads and optim ≈ 1/N. Shards can be uneven
(ZeroRedundancyOptimizer partitions whole tensors greedily; FSDP2 pads dim 0), so the table
shows the largest rank; every rank's numbers are in the JSON.

The FSDP plugin (`tabfm.parallel.plugins.fsdp.TorchFSDPPlugin`) is imported lazily; where it is
missing its rows are skipped with a note.
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
from torch import nn  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "engine_memory.json"
PLUGINS = ("ddp", "zero1", "zero2", "fsdp")
WORLD_SIZES = (1, 2, 4)
QUICK_WORLD_SIZES = (2,)
# one step's batch per rank: B tables x R rows x C columns, the first `context` rows are context
BATCH = dict(tables=4, rows=64, cols=16, context=48)
QUICK_BATCH = dict(tables=2, rows=16, cols=6, context=12)
QUICK_MODEL = dict(d_model=32, n_layers=2, n_heads=4, n_bins=16, n_thinking_rows=2)  # on the "small" preset
MIB = 1024 ** 2


# ----------------------------------------------------------------------------- plugins
def fsdp_plugin_class() -> tuple[Any, str | None]:
    """(TorchFSDPPlugin, None), or (None, why it is unavailable)."""
    try:
        from tabfm.parallel.plugins.fsdp import TorchFSDPPlugin
    except ImportError as e:
        return None, f"tabfm.parallel.plugins.fsdp.TorchFSDPPlugin not importable ({e})"
    return TorchFSDPPlugin, None


def make_plugin(kind: str, blocks: list[str] | None = None):
    """The plugin for `kind`, fp32. `blocks` (FSDP only): the modules to shard one by one;
    None lets the plugin read the model's `parallel_plan()`."""
    from tabfm.parallel.plugins.ddp import TorchDDPPlugin
    from tabfm.parallel.plugins.zero import LowLevelZeroPlugin

    if kind == "ddp":
        return TorchDDPPlugin(precision="fp32")
    if kind == "zero1":
        return LowLevelZeroPlugin(stage=1, precision="fp32")
    if kind == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="fp32")
    if kind == "fsdp":
        cls, why = fsdp_plugin_class()
        if cls is None:
            raise RuntimeError(why)
        return cls(precision="fp32", blocks=blocks) if blocks is not None else cls(precision="fp32")
    raise ValueError(f"unknown plugin {kind!r}; choose from {PLUGINS}")


def available_plugins(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    skipped = {}
    if "fsdp" in wanted:
        _, why = fsdp_plugin_class()
        if why:
            skipped["fsdp"] = why
    return [p for p in wanted if p not in skipped], skipped


# ------------------------------------------------------------------------------ bytes
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores: a DTensor's local shard, else `t` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_dtensor(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


def nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local_tensor(t)
    return t.numel() * t.element_size()


def param_bytes(model: nn.Module) -> int:
    return sum(nbytes(p) for p in model.parameters())


def grad_bytes(model: nn.Module) -> int:
    return sum(nbytes(p.grad) for p in model.parameters())


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that holds this rank's state: through the booster's wrapper and
    a ZeroRedundancyOptimizer (whose `.optim` is the local optimizer of its partition)."""
    opt = optimizer.unwrap() if hasattr(optimizer, "unwrap") else optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def optimizer_state_bytes(optimizer: Any) -> int:
    total = 0
    for state in inner_optimizer(optimizer).state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += nbytes(v)
    return total


class ParamPeak:
    """Largest parameter footprint seen at any module's forward: resting shards + the
    parameters currently all-gathered by FSDP2 (a DTensor at rest, a plain tensor now)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.resting = param_bytes(model)
        self.sharded = {n for n, p in model.named_parameters() if is_dtensor(p)}
        self.peak = self.resting
        self.handles = [m.register_forward_pre_hook(self._sample) for m in model.modules()]

    def _sample(self, module: nn.Module, args: Any) -> None:
        gathered = sum(nbytes(p) for n, p in self.model.named_parameters() if n in self.sharded and not is_dtensor(p))
        self.peak = max(self.peak, self.resting + gathered)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ------------------------------------------------------------------------------ model
def model_config(quick: bool):
    from tabfm.model import ModelConfig

    return ModelConfig.preset("small", **(QUICK_MODEL if quick else {}))


def make_batch(tables: int, rows: int, cols: int, context: int, seed: int = 0):
    """A synthetic prediction batch (as tests and benchmarks/model_speed.py build it): Gaussian
    numeric columns, ~30 % categorical columns with 5 codes, a categorical target in the last
    column hidden for the non-context rows."""
    from tabfm.data.batch import TableBatch

    g = torch.Generator().manual_seed(seed)
    kind = torch.where(torch.rand(tables, cols, generator=g) < 0.3, 2, 1).to(torch.int8)
    kind[:, -1] = 2
    card = torch.where(kind == 2, 5, 0).long()
    x = torch.randn(tables, rows, cols, generator=g)
    codes = torch.randint(0, 5, (tables, rows, cols), generator=g).float()
    x = torch.where(kind[:, None, :] == 2, codes, x)
    ctx = torch.zeros(tables, rows, dtype=torch.bool)
    ctx[:, :context] = True
    query = torch.zeros(tables, rows, cols, dtype=torch.bool)
    query[:, context:, -1] = True
    ones_r, ones_c = torch.ones(tables, rows, dtype=torch.bool), torch.ones(tables, cols, dtype=torch.bool)
    return TableBatch(x, kind, card, ones_r, ones_c, ctx, query).validate()


# ----------------------------------------------------------------------------- worker
def measure_worker(rank: int, world_size: int, plugin_kind: str, quick: bool, batch: dict, seed: int) -> dict:
    """One rank: build, boost, one training step, count bytes. Runs inside a spawned process."""
    from tabfm.parallel import Booster
    from tabfm.model import TabFM, masked_cell_loss

    rss_before = current_rss()
    torch.manual_seed(seed)
    model = TabFM(model_config(quick))
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    booster = Booster(plugin=make_plugin(plugin_kind))
    boosted, optimizer, *_ = booster.boost(model, optimizer)
    module = boosted.unwrap()
    data = make_batch(**batch, seed=seed + 1 + rank)

    tracker = ParamPeak(module)
    t0 = time.perf_counter()
    loss, _ = masked_cell_loss(boosted(data), data)
    booster.backward(loss, optimizer)
    optimizer.step()
    step_s = time.perf_counter() - t0
    tracker.remove()
    return {
        "rank": rank,
        "n_params": n_params,
        "loss": float(loss.detach()),
        "param_bytes": param_bytes(module),
        "grad_bytes": grad_bytes(module),
        "optim_bytes": optimizer_state_bytes(optimizer),
        "param_bytes_in_step": tracker.peak,
        "peak_rss_bytes": peak_rss(),
        "rss_before_model_bytes": rss_before,
        "rss_increase_bytes": peak_rss() - rss_before,
        "step_s": step_s,
    }


def run_config(plugin: str, world_size: int, quick: bool, batch: dict, seed: int, timeout_s: float) -> list[dict]:
    from tests.dist_utils import run_distributed

    return run_distributed(measure_worker, world_size=world_size, args=(plugin, quick, batch, seed),
                           timeout_s=timeout_s, pg_timeout_s=min(timeout_s, 300.0))


# ----------------------------------------------------------------------------- report
FIELDS = ("param_bytes", "grad_bytes", "optim_bytes", "param_bytes_in_step", "peak_rss_bytes", "rss_increase_bytes")
RATIO_FIELDS = {"param_bytes": "params", "grad_bytes": "grads", "optim_bytes": "optim"}


def summarise(rows: list[dict]) -> None:
    """Add the largest-rank figures and ratios vs DDP (same world size) to each row, in place."""
    for row in rows:
        for f in FIELDS:
            row[f] = max(r[f] for r in row["per_rank"])
    ddp = {r["world_size"]: r for r in rows if r["plugin"] == "ddp"}
    for row in rows:
        ref = ddp.get(row["world_size"])
        for f, short in RATIO_FIELDS.items():
            row[f"{short}_vs_ddp"] = (row[f] / ref[f]) if ref and ref[f] else None
        row["ideal_share"] = 1.0 / row["world_size"]


def print_table(rows: list[dict]) -> None:
    def ratio(v):
        return f"{v:.2f}" if v is not None else "—"

    head = ("plugin", "ranks", "params MiB", "grads MiB", "optim MiB", "params/ddp", "grads/ddp", "optim/ddp",
            "params in step MiB", "peak RSS MiB", "RSS rise MiB")
    print("\n| " + " | ".join(head) + " |")
    print("|---|---:|" + "---:|" * (len(head) - 2))
    for r in rows:
        print(f"| {r['plugin']} | {r['world_size']} | {r['param_bytes'] / MIB:.2f} | {r['grad_bytes'] / MIB:.2f} | "
              f"{r['optim_bytes'] / MIB:.2f} | {ratio(r['params_vs_ddp'])} | {ratio(r['grads_vs_ddp'])} | "
              f"{ratio(r['optim_vs_ddp'])} | {r['param_bytes_in_step'] / MIB:.2f} | {r['peak_rss_bytes'] / MIB:.0f} | "
              f"{r['rss_increase_bytes'] / MIB:.0f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugins", default=",".join(PLUGINS), help=f"comma-separated, from {','.join(PLUGINS)}")
    ap.add_argument("--world-sizes", default=None, help="comma-separated (default 1,2,4; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="toy model (small preset, d=32, 2 layers) and batch")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None,
                    help=f"output JSON (default {DEFAULT_JSON.relative_to(ROOT)}; not written with --quick unless given)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    wanted = [p.strip() for p in args.plugins.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PLUGINS))
    if unknown:
        raise SystemExit(f"unknown plugin(s) {unknown}; choose from {PLUGINS}")
    world_sizes = [int(w) for w in args.world_sizes.split(",")] if args.world_sizes else \
        list(QUICK_WORLD_SIZES if args.quick else WORLD_SIZES)
    plugins, skipped = available_plugins(wanted)
    batch = QUICK_BATCH if args.quick else BATCH

    def log(msg: str) -> None:
        print(f"[engine_memory] {msg}", file=sys.stderr, flush=True)

    started, load_start = time.time(), os.getloadavg()
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    rows = []
    for ws in world_sizes:
        for plugin in plugins:
            t0 = time.time()
            per_rank = run_config(plugin, ws, args.quick, batch, args.seed, args.timeout)
            rows.append({"plugin": plugin, "world_size": ws, "per_rank": per_rank})
            r0 = per_rank[0]
            log(f"{plugin:5} x{ws}: params {max(r['param_bytes'] for r in per_rank) / MIB:.2f} MiB, "
                f"grads {max(r['grad_bytes'] for r in per_rank) / MIB:.2f} MiB, "
                f"optim {max(r['optim_bytes'] for r in per_rank) / MIB:.2f} MiB, "
                f"peak RSS {max(r['peak_rss_bytes'] for r in per_rank) / MIB:.0f} MiB, "
                f"loss {r0['loss']:.4f} ({time.time() - t0:.1f} s)")
    summarise(rows)
    print_table(rows)
    for name, why in skipped.items():
        print(f"\nskipped {name}: {why}")
    load_end = os.getloadavg()
    cfg = model_config(args.quick)
    n_params = rows[0]["per_rank"][0]["n_params"] if rows else None
    print(f"\nmodel: TabFM small{' (quick: ' + str(QUICK_MODEL) + ')' if args.quick else ''}, {n_params:,} parameters; "
          f"batch per rank {batch}; AdamW, fp32, one step; largest rank shown; load average {load_start[0]:.2f} "
          f"at start, {load_end[0]:.2f} at end")
    machine = machine_info()
    machine.update(load_average_start=list(load_start), load_average_end=list(load_end))
    result = {
        "benchmark": "engine_memory",
        "command": " ".join([Path(sys.executable).name, "benchmarks/engine_memory.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "created_unix": started,
        "duration_s": time.time() - started,
        "machine": machine,
        "settings": {
            "model": "tabfm.model.TabFM(ModelConfig.preset('small'" + (f", **{QUICK_MODEL}" if args.quick else "") + "))",
            "model_config": cfg.to_dict(),
            "n_params": n_params,
            "batch_per_rank": batch,
            "optimizer": "torch.optim.AdamW(lr=1e-4, weight_decay=0.01)",
            "precision": "fp32",
            "step": "one training step: masked_cell_loss, booster.backward, optimizer.step; counted before zero_grad",
            "bytes": "local storage per rank (DTensor .to_local(), ZeroRedundancyOptimizer .optim.state); "
                     "row figures are the largest rank",
            "ratios": "vs ddp at the same world size",
        },
        "plugins": plugins,
        "world_sizes": world_sizes,
        "skipped": skipped,
        "rows": rows,
    }
    out = args.json if args.json is not None else (None if args.quick else str(DEFAULT_JSON))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
