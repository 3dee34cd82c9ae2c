"""bf16 attention on CPU: the fused AVX512-BF16 kernel (tabfm/model/cpu_kernels/attention.cpp) against
torch's SDPA in fp32 (what bf16 attention over > 128 keys ran before) and in bf16, and the
explicit formula (bf16 matmuls, fp32 softmax: what it ran over <= 128 keys), side by side.

    python benchmarks/cpu_attention.py [--threads 1] [--reps 5] [--quick]
                                       [--json benchmarks/results/cpu_attention.json]

Shapes are the attentions of a train step of `benchmarks/model_speed.py` (8 tables x 256
rows x 16 columns, 192 context rows): the row attention of each preset (queries = rows +
thinking rows, keys = context + thinking rows) and base's column attention (16 keys). Per
path: forward ms and forward + backward ms (best of --reps after a warm-up, process CPU
time), GFLOP/s (4 L S d per sequence forward, x2 backward), the speed-up over fp32 SDPA, and
the relative error of the output and of dQ against fp32 SDPA on the same bf16-exact inputs.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tabfm.model.attention import attend, explicit_attention
from tabfm.model.cpu_kernels import attention as cpu_attention
from tabfm.model.cpu_kernels import build

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "cpu_attention.json"

# name: (sequences N, heads H, queries L, keys S, head dim)
SHAPES = {
    "tiny row": (8 * 16, 4, 256, 192, 24),
    "small row": (8 * 16, 4, 264, 200, 32),
    "base row": (8 * 16, 6, 272, 208, 32),
    "base column": (8 * 272, 6, 16, 16, 32),
}
QUICK = {"toy row": (4, 2, 40, 150, 32), "toy column": (64, 2, 8, 8, 16)}


def _sdpa_fp32(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)


def _sdpa_bf16(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _explicit_bf16(q, k, v):
    return explicit_attention(q, k, v, None)


def _fused(q, k, v):
    return cpu_attention.fused_attention(q, k, v, None)


def _attend(q, k, v):
    return attend(q, k, v, None, 0.0)


def measure(fn, shape, reps: int, reference=None) -> dict:
    n, h, l, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, m, d, generator=g).bfloat16().requires_grad_() for m in (l, s, s))
    do = torch.randn(n, h, l, d, generator=g).bfloat16()
    fwd, total = [], []
    for _ in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        t0 = time.process_time()
        out = fn(q, k, v)
        t1 = time.process_time()
        out.backward(do)
        t2 = time.process_time()
        fwd.append(t1 - t0)
        total.append(t2 - t0)
    flops = 4 * n * h * l * s * d
    row = {"fwd_ms": 1e3 * min(fwd[1:]), "fwd_bwd_ms": 1e3 * min(total[1:])}
    row["fwd_gflops"] = flops / min(fwd[1:]) / 1e9
    row["fwd_bwd_gflops"] = 3 * flops / min(total[1:]) / 1e9
    if reference is not None:
        ref_out, ref_dq = reference
        row["out_rel_err"] = float((out.detach().float() - ref_out).norm() / ref_out.norm())
        row["dq_rel_err"] = float((q.grad.float() - ref_dq).norm() / ref_dq.norm())
    return row, (out.detach().float(), q.grad.float())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="toy shapes (smoke test)")
    ap.add_argument("--json", default=None, help=f"output JSON (default {DEFAULT_JSON.relative_to(ROOT)}; "
                                                  "not written with --quick unless given)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not build.available():
        raise SystemExit(f"fused CPU kernels unavailable here: {build.reason()}")
    paths = {"sdpa fp32": _sdpa_fp32, "sdpa bf16": _sdpa_bf16, "explicit bf16": _explicit_bf16,
             "fused bf16": _fused, "attend (model)": _attend}
    shapes = QUICK if args.quick else SHAPES
    rows = []
    for name, shape in shapes.items():
        ref_row, ref = measure(_sdpa_fp32, shape, args.reps)
        for path, fn in paths.items():
            row, _ = (ref_row, ref) if path == "sdpa fp32" else measure(fn, shape, args.reps, ref)
            rows.append({"shape": name, "dims": dict(zip("NHLSD", shape)), "path": path, **row,
                         "speedup": ref_row["fwd_bwd_ms"] / row["fwd_bwd_ms"]})
    print(f"\nbf16 attention on CPU, {args.threads} thread(s), best of {args.reps} (process CPU time)")
    print(f"{'shape':12} {'N x H x L x S x d':22} {'path':15} {'fwd ms':>8} {'fwd+bwd ms':>10} "
          f"{'GFLOP/s':>8} {'x fp32':>7} {'out err':>8} {'dQ err':>8}")
    for r in rows:
        dims = "x".join(str(v) for v in r["dims"].values())
        err = f"{r['out_rel_err']:8.4f} {r['dq_rel_err']:8.4f}" if "out_rel_err" in r else f"{'-':>8} {'-':>8}"
        print(f"{r['shape']:12} {dims:22} {r['path']:15} {r['fwd_ms']:8.1f} {r['fwd_bwd_ms']:10.1f} "
              f"{r['fwd_bwd_gflops']:8.1f} {r['speedup']:6.2f}x {err}")
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__}, "reps": args.reps, "rows": rows}
    out = args.json if args.json is not None else (None if args.quick else str(DEFAULT_JSON))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
