"""Smoke test of benchmarks/model_speed.py at toy sizes (a few seconds): the FLOP formulas
agree with FlopCounterMode on the matmuls, the TabPFN-v2 re-implementation has the v2
parameter count, and a --quick run produces the table and the JSON."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ms(load_benchmark):
    return load_benchmark("model_speed")


TOY = dict(tables=2, rows=16, cols=7, context=12)


def test_batch_and_tabpfn_inputs(ms):
    shape = ms.Shape(**TOY)
    batch = ms.make_batch(shape)
    assert batch.shape == (2, 16, 7) and shape.cells == 2 * 16 * 7
    assert int(batch.query.sum()) == 2 * (16 - 12) and bool(batch.query[:, 12:, -1].all())
    x, y, target = ms.tabpfn_inputs(batch, shape.context)
    assert x.shape == (16, 2, 6) and y.shape == (12, 2) and target.shape == (4, 2)
    assert int(target.max()) < ms.N_CLASSES_TARGET


def test_tabfm_flops_match_flop_counter(ms):
    shape = ms.Shape(**TOY)
    cfg = ms.ModelConfig.preset("tiny", d_model=32, n_heads=4, n_layers=2, n_thinking_rows=2)
    torch.manual_seed(0)
    model = ms.TabFM(cfg).train()
    step = ms.tabfm_train_step(model, ms._adamw(model), ms.make_batch(shape), "fp32")
    counted = ms.counted_matmul_flops(step)
    analytic = ms.tabfm_flops(cfg, shape)
    assert analytic["total"] == analytic["linear"] + analytic["attention"] > 0
    # the counter also sees the encoder and head matmuls (not the CPU SDPA): a little more
    assert counted is not None and analytic["linear"] <= counted <= 1.15 * analytic["linear"]
    assert ms.tabfm_flops(cfg, shape, train=False)["total"] == pytest.approx(analytic["total"] / 3)


def test_v2_reimplementation_flops_and_grad(ms):
    shape = ms.Shape(**TOY)
    torch.manual_seed(0)
    model = ms.V2LikeModel(32, 2, 4)
    inputs = ms.tabpfn_inputs(ms.make_batch(shape), shape.context)
    out = model(inputs[0], inputs[1])
    assert out.shape == (4, 2, ms.TABPFN_N_OUT) and torch.isfinite(out).all()
    step = ms.tabpfn_train_step(model, ms._adamw(model), inputs, "fp32")
    counted = ms.counted_matmul_flops(step)
    analytic = ms.tabpfn_v2_flops(32, 2, shape)
    assert counted is not None and analytic["linear"] <= counted <= 1.2 * analytic["linear"]
    assert all(p.grad is not None for p in model.blocks.parameters())


def test_v2_reimplementation_matches_package_size(ms):
    module, _ = ms.load_tabpfn_v2()
    if module is None:
        pytest.skip("tabpfn not installed (it is never a project dependency)")
    pkg = ms.build_tabpfn_v2(module, 32, 2, 4)
    ours = ms.V2LikeModel(32, 2, 4)
    assert sum(p.numel() for p in pkg.parameters()) == sum(p.numel() for p in ours.parameters())


def test_quick_run_writes_table_and_json(ms, tmp_path, capsys):
    out = tmp_path / "speed.json"
    result = ms.main(["--quick", "--reference", "reimpl", "--reps", "1", "--precisions", "fp32,bf16", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "x tabpfn" in printed and "tabpfn-v2-like (re-implemented)" in printed
    data = json.loads(out.read_text())
    assert data["reference"]["label"] == ms.LABEL_REIMPL
    for key in ("cpu_model", "threads", "load_average_start", "load_average_end", "torch_version"):
        assert key in data["machine"]
    rows = {(r["model"], r["precision"]): r for r in data["rows"]}
    assert set(rows) == {("tabfm", "fp32"), ("tabfm", "bf16"), ("tabpfn", "fp32"), ("tabpfn", "bf16")}
    for (model, _), r in rows.items():
        assert r["cells_per_s_cpu"] > 0 and r["cells_per_s_wall"] > 0 and r["infer_ms_wall"] > 0
        assert 0 < r["mfu_cpu"] < 10  # toy GEMM peak: MFU is only checked for being finite here
        assert (r["speedup_vs_tabpfn_cpu"] is not None) == (model == "tabfm")
    tabfm_fp32 = rows[("tabfm", "fp32")]
    assert math.isclose(tabfm_fp32["speedup_vs_tabpfn_cpu"],
                        tabfm_fp32["cells_per_s_cpu"] / rows[("tabpfn", "fp32")]["cells_per_s_cpu"])
    assert set(data["peak_gflops"]) == {"fp32", "bf16"}
    assert result["goals"] and all(g["preset"] == "tiny" for g in data["goals"])


# ------------------------------------------------- engine benchmarks (multi-process, --quick)
def _run_benchmark(name: str, args: list[str], tmp_path: Path, timeout_s: float) -> tuple[dict, str]:
    """Run benchmarks/<name>.py --quick as its own process (it spawns its ranks); return its JSON and stdout."""
    import subprocess

    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", *args, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_engine_memory_quick(tmp_path):
    data, printed = _run_benchmark("engine_memory", ["--world-sizes", "2"], tmp_path, 400)
    assert "| plugin | ranks |" in printed and "optim/ddp" in printed
    assert data["benchmark"] == "engine_memory" and data["world_sizes"] == [2]
    expected = {"ddp", "zero1", "zero2", "fsdp"} - set(data["skipped"])
    assert {"ddp", "zero1", "zero2"} <= expected
    rows = {r["plugin"]: r for r in data["rows"]}
    assert set(rows) == expected and all(r["world_size"] == 2 for r in rows.values())
    for r in rows.values():
        assert len(r["per_rank"]) == 2 and [p["rank"] for p in r["per_rank"]] == [0, 1]
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "param_bytes_in_step", "peak_rss_bytes"):
            assert r[key] > 0 and r[key] == max(p[key] for p in r["per_rank"])
        assert r["param_bytes_in_step"] >= r["param_bytes"]
        assert r["ideal_share"] == 0.5
    ddp, z1, z2 = rows["ddp"], rows["zero1"], rows["zero2"]
    assert ddp["params_vs_ddp"] == ddp["grads_vs_ddp"] == ddp["optim_vs_ddp"] == 1.0
    # ZeRO-1 shards only the optimizer state; ZeRO-2 also the gradients (and keeps the whole model
    # gathered through the step); FSDP shards all three
    assert z1["optim_bytes"] < ddp["optim_bytes"] and z1["optim_vs_ddp"] <= 0.75
    assert z1["param_bytes"] == ddp["param_bytes"] and z1["grad_bytes"] == ddp["grad_bytes"]
    assert z2["grad_bytes"] < ddp["grad_bytes"] and z2["optim_bytes"] < ddp["optim_bytes"]
    assert z2["param_bytes_in_step"] >= ddp["param_bytes"]
    if "fsdp" in rows:
        f = rows["fsdp"]
        assert f["param_bytes"] < ddp["param_bytes"] and f["grad_bytes"] < ddp["grad_bytes"]
        assert f["optim_bytes"] < ddp["optim_bytes"]
        assert f["params_vs_ddp"] <= 0.75 and f["grads_vs_ddp"] <= 0.75 and f["optim_vs_ddp"] <= 0.75


@pytest.mark.slow
def test_engine_overhead_quick(tmp_path):
    data, printed = _run_benchmark("engine_overhead", ["--deepspeed", "off"], tmp_path, 400)
    assert "booster/raw" in printed
    assert data["benchmark"] == "engine_overhead" and data["settings"]["ranks"] == 2
    assert data["peers"] == [] and "deepspeed" in data["skipped"]
    rows = {r["plugin"]: r for r in data["rows"]}
    assert {"ddp", "zero1", "zero2"} <= set(rows) == set(data["plugins"])
    reps = data["settings"]["reps"]
    for name, r in rows.items():
        for key in ("booster_ms", "raw_ms", "booster_over_raw", "booster_over_raw_cpu", "booster_vs_raw_ddp"):
            assert math.isfinite(r[key]) and r[key] > 0
        q1, q3 = r["booster_over_raw_per_round_iqr"]
        assert q1 <= r["booster_over_raw_per_round_median"] <= q3
        assert math.isclose(r["booster_over_raw"], r["booster_ms"] / r["raw_ms"])
        # the booster wraps the same sharding and the same math as the hand-wrapped model
        assert r["booster_optim_bytes"] == r["raw_optim_bytes"] > 0
        assert math.isclose(r["loss_booster"], r["loss_raw"], rel_tol=1e-4)
        for rank in data["per_rank"]:
            assert len(rank["variants"][f"booster_{name}"]["wall_s"]) == reps
    assert rows["ddp"]["raw_vs_raw_ddp"] == 1.0 and rows["ddp"]["optim_vs_ddp"] == 1.0
    for name in set(rows) - {"ddp"}:  # every sharded plugin keeps less optimizer state per rank than DDP
        assert rows[name]["booster_optim_bytes"] < rows["ddp"]["booster_optim_bytes"]


def test_inference_cache_quick(tmp_path):
    """Cached-context and per-chunk inference agree; the run writes its table and JSON."""
    data, stdout = _run_benchmark("inference_cache", [], tmp_path, timeout_s=300)
    assert "speed-up" in stdout and data["rows"]
    assert all(r["max_abs_diff"] < 1e-4 and r["cached_s"] > 0 for r in data["rows"])


def test_query_chunks_quick(tmp_path):
    """Padded and unpadded passes both run; a row predicted alone equals its answer in the big call."""
    data, stdout = _run_benchmark("query_chunks", [], tmp_path, timeout_s=300)
    assert "row alone == in batch" in stdout and len(data["rows"]) == 4
    assert all(r["last_row_alone_equal"] and r["padded_s"] > 0 and r["unpadded_s"] > 0 for r in data["rows"])


def test_checkpoint_io_quick(tmp_path):
    """One DCP and one plain-safetensors save/load of tiny: both bring zeroed weights back exactly."""
    data, stdout = _run_benchmark("checkpoint_io", [], tmp_path, timeout_s=300)
    (row,) = data["rows"]
    assert "dcp save" in stdout and row["preset"] == "tiny" and row["round_trip_exact"] is True
    assert row["ms"]["dcp_save"] > 0 and row["mib"]["dcp"] > 5


def test_activation_checkpointing_quick(tmp_path):
    """Checkpointed blocks keep less for backward at bit-identical losses; the run writes its table and JSON."""
    data, stdout = _run_benchmark("activation_checkpointing", [], tmp_path, timeout_s=300)
    assert "x memory" in stdout and len(data["rows"]) == 1
    row = data["rows"][0]
    assert row["saved_mib_ckpt"] < 0.5 * row["saved_mib_plain"] and row["max_loss_diff"] == 0.0


def test_cpu_attention_quick(tmp_path):
    """benchmarks/cpu_attention.py: every path on every shape, the bf16 paths close to fp32 SDPA."""
    from tabfm.model.cpu_kernels import build

    if not build.available():
        pytest.skip(f"fused CPU kernels unavailable: {build.reason()}")
    data, stdout = _run_benchmark("cpu_attention", ["--reps", "1"], tmp_path, timeout_s=300)
    assert "fused bf16" in stdout and "x fp32" in stdout
    paths = {(r["shape"], r["path"]) for r in data["rows"]}
    assert len(paths) == len(data["rows"]) == 10
    for r in data["rows"]:
        assert r["fwd_bwd_ms"] > 0 and r["fwd_bwd_gflops"] > 0
        if r["path"] != "sdpa fp32":
            assert r["out_rel_err"] < 0.01 and r["dq_rel_err"] < 0.01


def test_heldout_loss_compares_exports_on_the_same_batches(tmp_path, load_benchmark):
    """benchmarks/heldout_loss.py: one row per model and stream, equal to synthetic_eval by hand."""
    from tabfm.synth.stream import StreamConfig
    from tabfm.train.evaluate import synthetic_eval
    from tabfm.weights import load_model

    module = load_benchmark("heldout_loss")
    out = module.main(["--models", "tabfm-tiny,tabfm-tiny", "--streams", "tiny", "--batches", "2",
                       "--json", str(tmp_path / "h.json")])
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert len(rows) == len(out["rows"]) == 2 and rows[0]["loss"] == rows[1]["loss"]
    with torch.no_grad():
        want = synthetic_eval(StreamConfig.preset("tiny"), 0, 2)(load_model("tabfm-tiny").eval())
    assert math.isclose(rows[0]["loss"], want["loss"], rel_tol=1e-6)
    # models with and without context features are scored on the same tables and query cells
    pairs = module.paired_batches("tiny", ["knn-linear", "none"], 0, 3)
    for plain, wide in zip(pairs["none"], pairs["knn-linear"]):
        assert len(plain) == len(wide) and wide.shape[2] >= plain.shape[2]
        assert torch.equal(plain.query.sum((1, 2)), wide.query.sum((1, 2)))
