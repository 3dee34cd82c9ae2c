"""Step time of each data-parallel plugin through the Booster vs the same model wrapped by hand.

    python benchmarks/engine_overhead.py                    # 6 layers, d=256, 2 ranks x 1 thread, fp32
    python benchmarks/engine_overhead.py --quick            # toy model, 2 rounds (smoke, ~30 s)
    DS_ACCELERATOR=cpu /path/to/venv/bin/python benchmarks/engine_overhead.py   # + DeepSpeed ZeRO-1/2 as peers

Launches itself: one group of `--ranks` gloo processes (`torch.multiprocessing` spawn, through
`tests/dist_utils.run_distributed`: torchrun environment, one intra-op thread per process,
`tabfm.parallel.launch.launch`). No torchrun needed.

Every rank builds all variants in the same processes, each on its own copy of the same model
(same seed, same init), its own AdamW (lr 1e-4, weight decay 0.01) and the same per-rank batch:

    booster  Booster(plugin).boost(model, AdamW) -> zero_grad, forward, booster.backward, step
             (for zero2 / fsdp this includes the plugin's speed paths: AdamW stepped over the
             local shards, ring all-gather / reduce-scatter on gloo; see parallel/plugins/zero.py)
    raw      the same model wrapped by hand, torch defaults throughout:
      ddp    torch DDP + AdamW
      zero1  torch DDP + ZeroRedundancyOptimizer(AdamW)
      zero2  fully_shard(model, reshard_after_forward=False) (one FSDP2 group) + AdamW
      fsdp   fully_shard(block) per block, then fully_shard(model) (FSDP2 defaults) + AdamW
    deepspeed  where `deepspeed` imports (never a project dependency): deepspeed.initialize(model,
               AdamW) with ZeRO stage 1 and 2, fp32, `zero_allow_untested_optimizer`, as peers.
               Install it in a separate venv that sees this torch, and run with DS_ACCELERATOR=cpu:
                 python -m venv --system-site-packages VENV && VENV/bin/pip install wheel
                 DS_BUILD_OPS=0 VENV/bin/pip install --no-deps --no-build-isolation
                     deepspeed einops hjson msgpack ninja psutil    (one command)
               (an sdist: build isolation would pull a CUDA torch). It JIT-builds a small comm
               op with ninja the first time (a minute or two).

Timing: `--warmup` steps per variant first (optimizer state allocated); then `--reps` rounds,
each running every variant for `--steps` steps between two barriers (the rank-0 wall time of
that block / steps = one sample); the variant order rotates by one each round so no variant
always follows the same one. Reported: the median per variant, booster/raw (ratio of
medians, and the median of the per-round ratios with its interquartile range, which cancels
load drifts shared by both), the same ratio of median process CPU times (gloo blocks
while it waits, so CPU time is the work a rank did, less sensitive to the scheduler than
wall time on a loaded machine), each variant's median relative to raw DDP (and, in CPU time,
the median and interquartile range of the per-round ratios to raw DDP), and per-rank
optimizer-state bytes (local partition / DTensor shards; for DeepSpeed the AdamW moments of
its flat partition, with its fp32 master partition listed apart). Target: booster/raw within
3 % (for zero2 / fsdp the booster does less work than the raw wrapping, so below 1 there is the
speed-up, not noise); ZeRO-2 within 3 % of raw DDP at half its optimizer state. The machine is
shared: the ratios, not the milliseconds, are the result.

The model: a plain pre-norm transformer (nn.LayerNorm, qkv Linear, SDPA, out Linear, GELU
MLP 4x), `--layers` x `--d-model` with `--heads` heads, a linear head, MSE loss on a random
target; batch per rank `--batch` sequences x `--seq` tokens of random inputs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):  # the project, and engine_memory beside this script
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from benchmarks.common import machine_info  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "engine_overhead.json"
PLUGINS = ("ddp", "zero1", "zero2", "fsdp")
DS_STAGES = (1, 2)
TARGET = 1.03  # booster / raw within 3 %
ISSUE_REFERENCE = {"deepspeed_zero2_vs_ddp": 1.03, "deepspeed_zero1_vs_ddp": 1.05, "torch_fsdp2_vs_ddp": 1.13}
MIB = 1024 ** 2
FULL = dict(layers=6, d_model=256, heads=4, batch=8, seq=64, reps=15, steps=2, warmup=2)
QUICK = dict(layers=2, d_model=64, heads=4, batch=2, seq=16, reps=2, steps=1, warmup=1)


# ------------------------------------------------------------------------------ model
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.out(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PlainTransformer(nn.Module):
    def __init__(self, layers: int, d: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

    def parallel_plan(self):
        from tabfm.parallel.plan import ParallelPlan

        return ParallelPlan(blocks=[f"blocks.{i}" for i in range(len(self.blocks))], num_heads=self.blocks[0].heads)


# ----------------------------------------------------------------------------- bytes
def nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    to_local = getattr(t, "to_local", None)
    t = to_local() if callable(to_local) else t
    return t.numel() * t.element_size()


def state_bytes(optim: Any) -> int:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optim = optim.unwrap() if hasattr(optim, "unwrap") else optim
    if isinstance(optim, ZeroRedundancyOptimizer):
        optim = optim.optim  # this rank's partition
    return sum(nbytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor))


# --------------------------------------------------------------------------- variants
class Variant:
    def __init__(self, name: str, step: Callable[[], Any], optim_bytes: Callable[[], int],
                 param_bytes: Callable[[], int], extra: dict | None = None) -> None:
        self.name, self.step, self.optim_bytes, self.param_bytes = name, step, optim_bytes, param_bytes
        self.extra = extra or {}
        self.warm = 0  # steps already taken
        self.wall: list[float] = []
        self.cpu: list[float] = []


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def _plain_step(module: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(module(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _params(module: nn.Module) -> Callable[[], int]:
    return lambda: sum(nbytes(p) for p in module.parameters())


def build_raw(kind: str, model: PlainTransformer, x, y) -> Variant:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind in ("ddp", "zero1"):
        module = DDP(model)
        opt = _adamw(model.parameters()) if kind == "ddp" else ZeroRedundancyOptimizer(
            list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01)
    elif kind == "zero2":
        module = fully_shard(model, reshard_after_forward=False)
        opt = _adamw(model.parameters())
    elif kind == "fsdp":
        for blk in model.blocks:
            fully_shard(blk)
        module = fully_shard(model)
        opt = _adamw(model.parameters())
    else:
        raise ValueError(kind)
    return Variant(f"raw_{kind}", _plain_step(module, opt, x, y), lambda: state_bytes(opt), _params(model))


def build_booster(kind: str, model: PlainTransformer, x, y) -> Variant:
    from tabfm.parallel import Booster

    from engine_memory import make_plugin

    booster = Booster(plugin=make_plugin(kind))
    boosted, opt, *_ = booster.boost(model, _adamw(model.parameters()))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(boosted(x), y)
        booster.backward(loss, opt)
        opt.step()
        return float(loss.detach())

    return Variant(f"booster_{kind}", step, lambda: state_bytes(opt), _params(boosted.unwrap()))


def build_deepspeed(stage: int, model: PlainTransformer, x, y, micro_batch: int) -> Variant:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()), config=config)

    def step() -> float:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()  # steps and zeroes the gradients
        return float(loss.detach())

    def master_bytes() -> int:
        return sum(nbytes(t) for t in getattr(opt, "single_partition_of_fp32_groups", []))

    inner = getattr(opt, "optimizer", opt)  # DeepSpeedZeroOptimizer -> the torch AdamW over its flat partition
    return Variant(f"deepspeed_zero{stage}", step, lambda: state_bytes(inner), _params(model),
                   extra={"master_bytes": master_bytes, "deepspeed_version": deepspeed.__version__})


def deepspeed_status() -> tuple[bool, str]:
    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed not importable in this Python (it is never a project dependency)"
    return True, "deepspeed importable"


# ----------------------------------------------------------------------------- worker
def overhead_worker(rank: int, world_size: int, cfg: dict, plugins: list[str], with_deepspeed: bool,
                    seed: int) -> dict:
    import warnings

    import torch.distributed as dist

    # FSDP2 warns that the head's output is a view (harmless: nothing here modifies it in place)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    log = (lambda m: print(f"[engine_overhead] {m}", file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], generator=g)
    y = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], generator=g)

    def fresh() -> PlainTransformer:
        torch.manual_seed(seed)
        return PlainTransformer(cfg["layers"], cfg["d_model"], cfg["heads"])

    n_params = sum(p.numel() for p in fresh().parameters())
    variants: list[Variant] = []
    notes: dict[str, str] = {}
    for kind in plugins:
        variants.append(build_raw(kind, fresh(), x, y))
        variants.append(build_booster(kind, fresh(), x, y))
    if with_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for stage in DS_STAGES:
            ok, why = True, ""
            try:
                v = build_deepspeed(stage, fresh(), x, y, cfg["batch"])
                v.step()  # fail here, on every rank alike, rather than inside the timed rounds
                v.warm = 1  # that step counts as warm-up: every variant has taken the same steps below
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                ok, why = False, f"{type(e).__name__}: {e}"
            flags = [None] * world_size
            dist.all_gather_object(flags, (ok, why))
            if all(f[0] for f in flags):
                variants.append(v)
            else:
                notes[f"deepspeed_zero{stage}"] = next(f[1] for f in flags if not f[0])
                log(f"deepspeed ZeRO-{stage} skipped: {notes[f'deepspeed_zero{stage}']}")
    torch.set_num_threads(1)  # whatever a peer library set, every variant runs on one thread
    log(f"{len(variants)} variants built ({n_params:,} parameters each); warm-up {cfg['warmup']} step(s) each")
    for v in variants:
        for _ in range(cfg["warmup"] - v.warm):
            v.step()
    # one more step: the loss after `warmup` updates; the same loss for booster and raw means the same math
    losses = {v.name: v.step() for v in variants}
    for r in range(cfg["reps"]):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(cfg["steps"]):
                v.step()
            dist.barrier()
            v.wall.append((time.perf_counter() - t0) / cfg["steps"])
            v.cpu.append((time.process_time() - c0) / cfg["steps"])
        log(f"round {r + 1}/{cfg['reps']}: " + ", ".join(f"{v.name} {1e3 * v.wall[-1]:.0f}" for v in variants)
            + " ms/step")
    return {
        "rank": rank,
        "n_params": n_params,
        "threads": torch.get_num_threads(),
        "notes": notes,
        "variants": {
            v.name: {"wall_s": v.wall, "cpu_s": v.cpu, "optim_bytes": v.optim_bytes(), "param_bytes": v.param_bytes(),
                     "loss_after_warmup": losses[v.name],
                     **{k: (f() if callable(f) else f) for k, f in v.extra.items()}}
            for v in variants
        },
    }


# ----------------------------------------------------------------------------- report
def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _per_round_text(xs: list[float], refs: list[float]) -> str:
    ratios = [x / r for x, r in zip(xs, refs)]
    q1, q3 = _quartiles(ratios)
    return f"{statistics.median(ratios):.3f} [{q1:.3f}–{q3:.3f}]"


def summarise(per_rank: list[dict], plugins: list[str]) -> dict:
    r0 = per_rank[0]["variants"]
    med = {name: statistics.median(v["wall_s"]) for name, v in r0.items()}
    med_cpu = {name: statistics.median(v["cpu_s"]) for name, v in r0.items()}
    optim = {name: max(r["variants"][name]["optim_bytes"] for r in per_rank) for name in r0}
    ref = med.get("raw_ddp")
    ref_cpu = med_cpu.get("raw_ddp")
    ref_optim = optim.get("raw_ddp")
    rows = []
    for kind in plugins:
        b, raw = f"booster_{kind}", f"raw_{kind}"
        per_round = [bw / rw for bw, rw in zip(r0[b]["wall_s"], r0[raw]["wall_s"])]
        q1, q3 = _quartiles(per_round)
        # CPU time of the booster over raw DDP's in the same round (load drifts shared by both cancel)
        cpu_vs_ddp = [bc / dc for bc, dc in zip(r0[b]["cpu_s"], r0["raw_ddp"]["cpu_s"])] if ref else []
        rows.append({
            "plugin": kind, "booster_ms": 1e3 * med[b], "raw_ms": 1e3 * med[raw],
            "booster_cpu_ms": 1e3 * med_cpu[b], "raw_cpu_ms": 1e3 * med_cpu[raw],
            "booster_over_raw": med[b] / med[raw],
            "booster_over_raw_cpu": med_cpu[b] / med_cpu[raw],
            "booster_over_raw_per_round_median": statistics.median(per_round),
            "booster_over_raw_per_round_iqr": [q1, q3],
            "within_target": med[b] / med[raw] <= TARGET,
            "booster_vs_raw_ddp": med[b] / ref if ref else None,
            "raw_vs_raw_ddp": med[raw] / ref if ref else None,
            "booster_vs_raw_ddp_cpu": med_cpu[b] / ref_cpu if ref_cpu else None,
            "booster_vs_raw_ddp_cpu_per_round_median": statistics.median(cpu_vs_ddp) if cpu_vs_ddp else None,
            "booster_vs_raw_ddp_cpu_per_round_iqr": list(_quartiles(cpu_vs_ddp)) if cpu_vs_ddp else None,
            "booster_optim_bytes": optim[b], "raw_optim_bytes": optim[raw],
            "optim_vs_ddp": optim[b] / ref_optim if ref_optim else None,
            "loss_booster": r0[b]["loss_after_warmup"], "loss_raw": r0[raw]["loss_after_warmup"],
        })
    peers = []
    for name in sorted(n for n in r0 if n.startswith("deepspeed_")):
        peers.append({
            "peer": name, "ms": 1e3 * med[name], "cpu_ms": 1e3 * med_cpu[name],
            "vs_raw_ddp": med[name] / ref if ref else None,
            "vs_raw_ddp_cpu": med_cpu[name] / ref_cpu if ref_cpu else None,
            "cpu_vs_raw_ddp_per_round": _per_round_text(r0[name]["cpu_s"], r0["raw_ddp"]["cpu_s"]) if ref else "—",
            "optim_bytes": optim[name], "optim_vs_ddp": optim[name] / ref_optim if ref_optim else None,
            "master_bytes": max(r["variants"][name].get("master_bytes", 0) for r in per_rank),
            "loss": r0[name]["loss_after_warmup"],
        })
    return {"rows": rows, "peers": peers, "median_wall_s": med, "median_cpu_s": med_cpu}


def print_table(summary: dict) -> None:
    def f(v, fmt="{:.3f}"):
        return fmt.format(v) if v is not None else "—"

    head = ("variant", "booster ms/step", "raw ms/step", "booster/raw wall", "per-round [IQR]", "booster/raw CPU",
            "vs raw DDP wall", "vs raw DDP CPU", "per-round [IQR]", "optim MiB/rank", "optim/DDP")
    print("\n| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for r in summary["rows"]:
        q1, q3 = r["booster_over_raw_per_round_iqr"]
        cq = r["booster_vs_raw_ddp_cpu_per_round_iqr"]
        cpu_rounds = (f"{r['booster_vs_raw_ddp_cpu_per_round_median']:.3f} [{cq[0]:.3f}–{cq[1]:.3f}]"
                      if cq is not None else "—")
        print(f"| {r['plugin']} | {r['booster_ms']:.0f} | {r['raw_ms']:.0f} | {r['booster_over_raw']:.3f} | "
              f"{r['booster_over_raw_per_round_median']:.3f} [{q1:.3f}–{q3:.3f}] | {r['booster_over_raw_cpu']:.3f} | "
              f"{f(r['booster_vs_raw_ddp'])} | {f(r['booster_vs_raw_ddp_cpu'])} | {cpu_rounds} | "
              f"{r['booster_optim_bytes'] / MIB:.2f} | {f(r['optim_vs_ddp'], '{:.2f}')} |")
    for p in summary["peers"]:
        print(f"| {p['peer']} (peer) | — | {p['ms']:.0f} | — | — | — | {f(p['vs_raw_ddp'])} | "
              f"{f(p['vs_raw_ddp_cpu'])} | {p['cpu_vs_raw_ddp_per_round']} | "
              f"{p['optim_bytes'] / MIB:.2f} (+{p['master_bytes'] / MIB:.2f} fp32 master) | "
              f"{f(p['optim_vs_ddp'], '{:.2f}')} |")
    print("\nvs raw DDP: the booster's median (the peer's, for DeepSpeed) over raw torch DDP's, wall and CPU time; "
          "per-round: the median [IQR] of the CPU-time ratios to raw DDP within each round")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugins", default=",".join(PLUGINS), help=f"comma-separated, from {','.join(PLUGINS)}")
    ap.add_argument("--ranks", type=int, default=2)
    for k in ("layers", "d_model", "heads", "batch", "seq", "reps", "steps", "warmup"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None,
                        help=f"default {FULL[k]} ({QUICK[k]} with --quick)")
    ap.add_argument("--quick", action="store_true", help="toy model, 2 rounds of 1 step (smoke)")
    ap.add_argument("--deepspeed", choices=("auto", "off"), default="auto",
                    help="auto: add DeepSpeed ZeRO-1/2 peers where deepspeed imports")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None,
                    help=f"output JSON (default {DEFAULT_JSON.relative_to(ROOT)}; not written with --quick unless given)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = QUICK if args.quick else FULL
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else base[k]) for k in base}
    wanted = [p.strip() for p in args.plugins.split(",") if p.strip()]
    unknown = sorted(set(wanted) - set(PLUGINS))
    if unknown:
        raise SystemExit(f"unknown plugin(s) {unknown}; choose from {PLUGINS}")
    from engine_memory import available_plugins

    plugins, skipped = available_plugins(wanted)
    with_ds, ds_note = (False, "--deepspeed off") if args.deepspeed == "off" else deepspeed_status()

    def log(msg: str) -> None:
        print(f"[engine_overhead] {msg}", file=sys.stderr, flush=True)

    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    log(f"{args.ranks} ranks x 1 thread, {cfg}; plugins {plugins}; deepspeed: {ds_note}")
    started, load_start = time.time(), os.getloadavg()
    from tests.dist_utils import run_distributed

    per_rank = run_distributed(overhead_worker, world_size=args.ranks,
                               args=(cfg, plugins, with_ds, args.seed), timeout_s=args.timeout,
                               pg_timeout_s=min(args.timeout, 600.0))
    load_end = os.getloadavg()
    skipped.update(per_rank[0]["notes"])
    if not with_ds:
        skipped["deepspeed"] = ds_note
    summary = summarise(per_rank, plugins)
    print_table(summary)
    for name, why in skipped.items():
        print(f"\nskipped {name}: {why}")
    n_params = per_rank[0]["n_params"]
    print(f"\nmodel: plain transformer, {cfg['layers']} layers, d={cfg['d_model']}, {cfg['heads']} heads, "
          f"{n_params:,} parameters; batch per rank {cfg['batch']} x {cfg['seq']} tokens; {args.ranks} ranks x 1 "
          f"thread, fp32, AdamW; median of {cfg['reps']} interleaved rounds of {cfg['steps']} step(s) "
          f"(rank-0 wall); load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
    machine = machine_info()
    machine.update(load_average_start=list(load_start), load_average_end=list(load_end))
    result = {
        "benchmark": "engine_overhead",
        "command": " ".join([Path(sys.executable).name, "benchmarks/engine_overhead.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "created_unix": started,
        "duration_s": time.time() - started,
        "machine": machine,
        "settings": {**cfg, "ranks": args.ranks, "n_params": n_params, "precision": "fp32",
                     "optimizer": "torch.optim.AdamW(lr=1e-4, weight_decay=0.01)",
                     "timing": "per round every variant runs `steps` steps between barriers (rank-0 wall / steps); "
                               "order rotates each round; medians over rounds",
                     "target_booster_over_raw": TARGET, "issue_reference": ISSUE_REFERENCE},
        "plugins": plugins,
        "skipped": skipped,
        **summary,
        "per_rank": per_rank,
    }
    out = args.json if args.json is not None else (None if args.quick else str(DEFAULT_JSON))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
