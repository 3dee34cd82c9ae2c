"""The Triton kernels of `tabfm.parallel.kernels` against torch: correctness everywhere,
speed only on a GPU.

    python benchmarks/triton_kernels.py [--device auto|cuda|cpu] [--quick] [--no-model]
                                        [--presets tiny,small,base] [--json PATH]

Per kernel (add + RMSNorm, RMSNorm alone, GELU tanh, target log-prob) and shape (the blocks'
token count of the main model_speed shape, 8 tables x 256 rows x 16 columns = 32,768 tokens, at
each preset's width; GELU at the MLP width):

- correctness: max |kernel - torch| of the outputs and of every input gradient, fp32 (and bf16
  on CUDA), relative to max |torch|;
- on CUDA only: forward and forward + backward time (`triton.testing.do_bench`, median ms) of
  the Triton kernel, torch eager (the same formula as the model's torch path) and
  `torch.compile` of that formula, and the kernel's effective bandwidth (minimal bytes moved /
  time);
- on CUDA, unless --no-model: a bf16-autocast train step (forward, loss, backward, AdamW) of
  each preset with the kernels on and with ``TABFM_TRITON=0``: ms per step, cells/s and MFU
  against a measured bf16 matmul peak (8192^3 `torch.matmul`), FLOPs as model_speed.py counts
  them (blocks only); then, torch's ops, the same step on 16 batches of the pretraining stream
  (pretrain-classes with the knn-linear columns: variable shapes) - what `tabfm pretrain` runs
  apart from its data loading.

On CPU (``--device cpu``, e.g. with --quick in the GPU-run rehearsal) the kernels run under
triton's interpreter (``TRITON_INTERPRET=1``, set by this script before triton is imported) in
fp32 at small shapes: the correctness table only, nothing is timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when torch sees one; cpu: interpreter, correctness only")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions (smoke)")
    ap.add_argument("--no-model", action="store_true", help="skip the train-step comparison (CUDA)")
    ap.add_argument("--presets", default="tiny,small,base")
    ap.add_argument("--widths", default=None,
                    help="comma-separated model widths of the CUDA kernel cases (default 96,128,192: each costs a "
                         "torch.compile)")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # the kernels are opt-in; this script measures them (and torch's ops beside them)
    os.environ["TABFM_TRITON"] = "1"
if ARGS is not None and ARGS.device == "cpu":  # before triton (or torch, which may import it) loads
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["TABFM_TRITON_CPU"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(ROOT))
from tabfm.model import ModelConfig, TabFM, masked_cell_loss  # noqa: E402
from tabfm.parallel import kernels as tk  # noqa: E402
from tabfm.parallel.kernels import dispatch  # noqa: E402


# ------------------------------------------------------------------------------ the cases
def _norm_case(rows, d, dtype, device, residual=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g).to(device, dtype)
    r = torch.randn(rows, d, generator=g).to(device, dtype) if residual else None
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, torch.float32)
    leaves = [t for t in (x, r, w) if t is not None]

    if not residual:
        return leaves, (lambda x, w: (tk.rms_norm(x, w, 1e-5),)), \
            (lambda x, w: (F.rms_norm(x, (d,), w, 1e-5),)), rows * d * x.element_size() * 2

    def kernel(x, r, w):
        return tk.add_rms_norm(x, r, w, 1e-5)

    def torch_ref(x, r, w):
        s = x + r
        return s, F.rms_norm(s, (d,), w, 1e-5)

    return leaves, kernel, torch_ref, rows * d * x.element_size() * 4  # read x, r; write s, y


def _gelu_case(rows, d, dtype, device):
    h = torch.randn(rows, d, generator=torch.Generator().manual_seed(1)).mul(2).to(device, dtype)
    return [h], (lambda h: (tk.bias_gelu(h, None, "tanh"),)), (lambda h: (F.gelu(h, approximate="tanh"),)), \
        rows * d * h.element_size() * 2


def _logprob_case(rows, k, dtype, device):
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(rows, k, generator=g) * 3).to(device, torch.float32)
    t = torch.randint(0, k, (rows,), generator=g).to(device)
    return [z], (lambda z: (tk.target_log_prob(z, t),)), \
        (lambda z: (F.log_softmax(z, -1).gather(-1, t[:, None])[:, 0],)), rows * k * 4 + rows * 12


def cases(device: str, quick: bool, dtypes, widths: tuple[int, ...] | None = None) -> list[tuple]:
    """(name, dtype, leaves-builder args) for every kernel and shape."""
    out = []
    if device == "cpu":
        shapes = {"rows": 257, "widths": widths or (96, 130)}
    else:
        shapes = {"rows": 4096 if quick else 32768, "widths": widths or (96, 128, 192)}
    rows = shapes["rows"]
    for dtype in dtypes:
        # on CUDA fp32 at one width only: each case costs a torch.compile
        widths = shapes["widths"] if device == "cpu" or dtype != torch.float32 else shapes["widths"][:1]
        for d in widths:
            out.append((f"add_rms_norm rows={rows} d={d}", dtype, _norm_case, (rows, d, dtype, device, True)))
            out.append((f"rms_norm rows={rows} d={d}", dtype, _norm_case, (rows, d, dtype, device, False)))
            out.append((f"gelu_tanh rows={rows} d={2 * d}", dtype, _gelu_case, (rows, 2 * d, dtype, device)))
        if dtype == torch.float32:
            for k in (10, 128):
                out.append((f"target_log_prob rows={rows} k={k}", dtype, _logprob_case, (rows, k, dtype, device)))
    return out


def _fwd_bwd(fn, leaves, seeds):
    ls = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in leaves]
    outs = fn(*ls)
    torch.autograd.backward(list(outs), seeds)
    return [o.detach() for o in outs], [t.grad for t in ls]


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check(name, dtype, builder, args) -> dict:
    leaves, kernel, ref, nbytes = builder(*args)
    ref_leaves = [t.float() if t.is_floating_point() else t for t in leaves]  # reference in fp32
    outs_r = ref(*ref_leaves)
    seeds = [torch.randn_like(o) for o in outs_r]
    (ko, kg), (ro, rg) = _fwd_bwd(kernel, leaves, [s.to(o.dtype) for s, o in zip(seeds, kernel(*leaves))]), \
        _fwd_bwd(ref, ref_leaves, seeds)
    row = {"kernel": name, "dtype": str(dtype).replace("torch.", ""),
           "max_rel_err_out": max(_rel_err(a, b) for a, b in zip(ko, ro)),
           "max_rel_err_grad": max(_rel_err(a, b) for a, b in zip(kg, rg) if a is not None),
           "min_bytes": nbytes}
    return row


def time_case(row, builder, args, quick: bool) -> None:
    import triton.testing

    leaves, kernel, ref, nbytes = builder(*args)
    compiled = torch.compile(ref, dynamic=False)
    rep, warm = (20, 5) if quick else (100, 25)
    for label, fn in (("triton", kernel), ("eager", ref), ("compile", compiled)):
        ls = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in leaves]
        seeds = [torch.randn_like(o) for o in fn(*ls)]

        def fwd():
            with torch.no_grad():
                fn(*ls)

        def fwd_bwd():
            torch.autograd.backward(list(fn(*ls)), seeds)

        for _ in range(3):
            fwd_bwd()  # compile / autotune outside the timing
        row[f"{label}_fwd_ms"] = float(triton.testing.do_bench(fwd, warmup=warm, rep=rep))
        row[f"{label}_fwd_bwd_ms"] = float(triton.testing.do_bench(fwd_bwd, warmup=warm, rep=rep, grad_to_none=ls))
    row["triton_fwd_gbps"] = nbytes / (row["triton_fwd_ms"] * 1e-3) / 1e9
    for other in ("eager", "compile"):
        row[f"speedup_fwd_vs_{other}"] = row[f"{other}_fwd_ms"] / row["triton_fwd_ms"]
        row[f"speedup_fwd_bwd_vs_{other}"] = row[f"{other}_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]


# ------------------------------------------------------------------------------ train step (CUDA)
def matmul_peak_tflops(n: int = 8192) -> float:
    import triton.testing

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def train_steps(presets, quick: bool, log) -> dict:
    import triton.testing

    import model_speed as ms_mod  # a sibling script: benchmarks/ is on sys.path when this one runs
    shape = ms_mod.QUICK_TRAIN_SHAPE if quick else ms_mod.TRAIN_SHAPE
    batch = ms_mod.make_batch(shape).to("cuda")
    cells = shape.tables * shape.rows * shape.cols
    peak = matmul_peak_tflops(4096 if quick else 8192)
    stream = stream_batches(2 if quick else 16)
    out = {"shape": vars(shape) if hasattr(shape, "__dict__") else str(shape), "bf16_matmul_peak_tflops": peak, "presets": {},
           "stream": f"{STREAM}, context features {STREAM_FEATURES}, {len(stream)} batches"}
    for name in presets:
        cfg = ModelConfig.preset(name)
        torch.manual_seed(0)
        model = TabFM(cfg).cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = masked_cell_loss(model(batch), batch)
            loss.backward()
            opt.step()

        flops = ms_mod.tabfm_flops(cfg, shape)["total"]
        res = {}
        for label, on in (("triton", True), ("torch", False)):
            use_kernels(on)
            for _ in range(3):
                step()
            ms = float(triton.testing.do_bench(step, warmup=10, rep=50 if quick else 300))
            res[label] = {"ms_per_step": ms, "cells_per_s": cells / (ms * 1e-3),
                          "mfu": flops / (ms * 1e-3) / (peak * 1e12)}
            log(f"train step {name} bf16 [{label}]: {ms:.2f} ms, {res[label]['cells_per_s']:.3g} cells/s, "
                f"MFU {100 * res[label]['mfu']:.1f} %")
        res["speedup"] = res["torch"]["ms_per_step"] / res["triton"]["ms_per_step"]
        res["stream"] = stream_steps(name, stream, "cuda", log)  # the kernels are still off: torch's ops
        use_kernels(True)
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["presets"][name] = res
        del model, opt
        torch.cuda.empty_cache()
    return out


STREAM, STREAM_FEATURES = "pretrain-classes", "knn-linear"


def use_kernels(on: bool) -> None:
    """Switch the Triton kernels on or off for what runs next (the dispatch decision is re-made)."""
    os.environ["TABFM_TRITON"] = "1" if on else "0"
    dispatch.reset()


def stream_batches(n: int, device: str = "cuda") -> list:
    """n batches of the pretraining stream (the GPU run's `tabfm pretrain` reads these)."""
    from tabfm.synth.dataset import SynthDataset, SynthLoader
    from tabfm.synth.stream import StreamConfig

    cfg = dataclasses.replace(StreamConfig.preset(STREAM), context_features=STREAM_FEATURES)
    it = iter(SynthLoader(SynthDataset(cfg, seed=0), num_workers=0))
    return [next(it).to(device) for _ in range(n)]


def stream_steps(name: str, stream: list, device: str, log) -> dict:
    """ms per train step and cells/s of preset `name` (with the stream's context features) on the
    stream's batches: bf16 autocast on CUDA, fp32 on CPU (the rehearsal)."""
    cfg = dataclasses.replace(ModelConfig.preset(name), context_features=STREAM_FEATURES)
    torch.manual_seed(0)
    model = TabFM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

    def step(b):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, _ = masked_cell_loss(model(b), b)
        loss.backward()
        opt.step()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for b in stream[:3]:  # warm-up
        step(b)
    sync()
    t0 = time.perf_counter()
    for b in stream:
        step(b)
    sync()
    sec = (time.perf_counter() - t0) / len(stream)
    res = {"ms_per_step": 1e3 * sec, "cells_per_s": sum(b.num_cells for b in stream) / len(stream) / sec,
           "shapes": [list(b.x.shape[:3]) for b in stream]}
    log(f"train step {name} on {len(stream)} stream batches ({device}, torch's ops): {1e3 * sec:.2f} ms, "
        f"{res['cells_per_s']:.3g} cells/s")
    # where a step's time goes: the top ops of a few steps by self CPU time and by device time
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for b in stream[:4]:
            step(b)
        sync()
    events = prof.key_averages()
    res["profile_cpu"] = events.table(sort_by="self_cpu_time_total", row_limit=15)
    log(f"profile of 4 stream steps ({name}), by self CPU time:\n{res['profile_cpu']}")
    if device == "cuda":
        res["profile_cuda"] = events.table(sort_by="self_device_time_total", row_limit=15)
        log(f"profile of 4 stream steps ({name}), by self device time:\n{res['profile_cuda']}")
    return res


# ------------------------------------------------------------------------------ main
def main(args: argparse.Namespace) -> dict:
    def log(msg: str) -> None:
        print(f"[triton_kernels] {msg}", file=sys.stderr, flush=True)

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            raise SystemExit("no CUDA device: rerun with --device cpu (interpreter, correctness only)")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    if not dispatch.enabled():
        raise SystemExit(f"Triton kernels are off: {dispatch.reason()}")
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    import triton

    info["triton"] = triton.__version__
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    widths = tuple(int(w) for w in args.widths.split(",")) if args.widths else None
    result = {"info": info, "kernels": [], "partial": True}
    started = time.time()
    todo = cases(device, args.quick, dtypes, widths)
    for name, dtype, builder, bargs in todo:  # correctness first: seconds, and it survives a timeout
        row = check(name, dtype, builder, bargs)
        log(f"{name} {row['dtype']}{' (interpreter)' if device == 'cpu' else ''}: max rel err out "
            f"{row['max_rel_err_out']:.1e}, grad {row['max_rel_err_grad']:.1e}")
        result["kernels"].append(row)
    _write(args.json, result)
    if device == "cuda" and not args.no_model:  # before the kernel timings: each of those costs a compile
        result["train_step_bf16"] = train_steps(args.presets.split(","), args.quick, log)
        _write(args.json, result)
    if device == "cpu" and not args.no_model:  # the rehearsal: the stream step's code path, torch's ops
        use_kernels(False)
        result["train_step_stream_cpu"] = stream_steps("tiny", stream_batches(2, "cpu"), "cpu", log)
        use_kernels(True)
        _write(args.json, result)
    if device == "cuda":
        for row, (name, _, builder, bargs) in zip(result["kernels"], todo):
            time_case(row, builder, bargs, args.quick)
            log(f"{name} {row['dtype']}: fwd {row['triton_fwd_ms']:.3f} ms ({row['triton_fwd_gbps']:.0f} GB/s) vs "
                f"eager {row['eager_fwd_ms']:.3f} / compile {row['compile_fwd_ms']:.3f}; fwd+bwd "
                f"{row['triton_fwd_bwd_ms']:.3f} vs {row['eager_fwd_bwd_ms']:.3f} / {row['compile_fwd_bwd_ms']:.3f}")
            _write(args.json, result)
    result.pop("partial")
    rows = result["kernels"]
    bad = [r["kernel"] for r in rows if r["dtype"] == "float32" and max(r["max_rel_err_out"], r["max_rel_err_grad"]) > 1e-4]
    result["fp32_ok"] = not bad
    result["seconds"] = time.time() - started
    if bad:
        log(f"FAIL: fp32 error above 1e-4 in {bad}")
    if args.json:
        _write(args.json, result)
        log(f"wrote {args.json}")
    return result


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    res = main(ARGS)
    sys.exit(0 if res["fp32_ok"] else 1)
