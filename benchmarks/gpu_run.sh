#!/usr/bin/env bash
# The one prepared GPU run (issue #22): at most ~12 minutes on one CUDA GPU (an H200), writing
# everything under $OUT (default benchmarks/results/gpu_run/).
#
#   bash benchmarks/gpu_run.sh                 # on the GPU machine
#   GPU_RUN_DRY=1 bash benchmarks/gpu_run.sh   # rehearsal on CPU: tiny sizes, interpreter, minutes
#   GPU_RUN_PACK="$OUT" OUT=/tmp/g GPU_RUN_SECONDS=540 GPU_RUN_INIT=runs/x/export \
#       GPU_RUN_ARGS="--data runs/real-corpus --data-share 0.25" GPU_RUN_INIT_ARGS="--lr 1e-4 --warmup-steps 30" \
#       PYTHON=python3 bash benchmarks/gpu_run.sh   # through the device tool (BENCHMARKS.md, "The GPU run")
#
# Steps (each bounded by `timeout`; a failing step is logged in summary.json and the script goes on):
#  1. versions.json (python, torch, triton, CUDA, GPU) and nvidia-smi.txt;
#  2. the CUDA test subset (<= 90 s): tests/test_gemini_cuda.py and the CUDA tests of
#     tests/test_triton_kernels.py -> pytest_cuda.log / .xml (dry: the same files on CPU, where the
#     CUDA tests skip and the kernel tests run under the interpreter);
#  3. benchmarks/triton_kernels.py (<= 2 min): correctness of each Triton kernel, bf16 train steps of
#     tiny/small with the kernels on / off (cells/s, MFU against the measured bf16 matmul peak), then
#     each kernel timed vs torch eager and torch.compile at width 128 -> triton_kernels.json (written
#     after each part, so a timeout keeps what was measured; dry: --device cpu --quick, correctness only);
#     benchmarks/model_speed.py is CPU-only (no device option), so it is not run here;
#  4. benchmarks/gemini_capacity.py --device cuda (<= 1 min) -> gemini_capacity_cuda.json
#     (dry: --quick on the CPU tier);
#  5. with the time left (GPU_RUN_SECONDS, default 720, minus what steps 1-4 took, minus 60 s for
#     the export): `tabfm pretrain --preset small` from scratch on pretrain-classes with the
#     knn-linear columns, bf16, into $OUT/small, and beside it, when GPU_RUN_INIT names an export,
#     that model continued into $OUT/init (see step 5 for GPU_RUN_ARGS / GPU_RUN_INIT_ARGS); both
#     checkpoint and export on expiry (dry: --preset smoke, a few steps), on torch's ops (the
#     Triton kernels are opt-in: TABFM_TRITON=1);
#  6. summary.json: each step's exit status and seconds, and the kernel/train-step results.
# Exit status: 0 if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results/gpu_run}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
DRY="${GPU_RUN_DRY:-0}"
TOTAL="${GPU_RUN_SECONDS:-720}"
START=$(date +%s)
STEPS_FILE="$OUT_DIR/steps.tsv"
: > "$STEPS_FILE"
if [ "$DRY" = "1" ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    echo "== GPU_RUN_DRY=1: rehearsal on CPU (tiny sizes, triton interpreter)"
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
fi

# step NAME LIMIT_S LOGFILE -- CMD...: run CMD under `timeout`, tee its output, record status + seconds
step() {
    local name="$1" limit="$2" log="$3"
    shift 4
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local dt=$(( $(date +%s) - t0 ))
    [ "$rc" -eq 0 ] || echo "FAIL: $name exited $rc after ${dt}s (log: $log)" >&2
    [ "$rc" -eq 124 ] && echo "FAIL: $name hit its ${limit}s timeout" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$log" >> "$STEPS_FILE"
}

# 1. versions
step versions 60 "$OUT_DIR/versions.log" -- "$PY" - "$OUT_DIR/versions.json" <<'EOF'
import json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
try:
    import triton
    info["triton"] = triton.__version__
except Exception as err:
    info["triton"] = f"not importable: {err}"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())
print(json.dumps(info, indent=1))
open(sys.argv[1], "w").write(json.dumps(info, indent=1))
EOF
if command -v nvidia-smi > /dev/null; then
    nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv >> "$OUT_DIR/nvidia-smi.txt" 2>&1
else
    echo "nvidia-smi not found" > "$OUT_DIR/nvidia-smi.txt"
fi
if [ "$DRY" != "1" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "WARNING: torch sees no CUDA GPU; the CUDA steps will fail or skip (GPU_RUN_DRY=1 rehearses on CPU)" >&2
fi

# 2. the CUDA test subset
step pytest_cuda 90 "$OUT_DIR/pytest_cuda.log" -- "$PY" -m pytest -q -rsf -p no:cacheprovider \
    tests/test_gemini_cuda.py tests/test_triton_kernels.py -k "not under_interpreter" \
    --junitxml "$OUT_DIR/pytest_cuda.xml"
if [ "$DRY" = "1" ]; then  # here the kernel tests need the interpreter (a subprocess of this test)
    step pytest_interpret 120 "$OUT_DIR/pytest_interpret.log" -- "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_triton_kernels.py -k "under_interpreter or dispatch"
fi

# 3. kernel benchmarks (+ train steps on CUDA)
if [ "$DRY" = "1" ]; then
    step triton_kernels 180 "$OUT_DIR/triton_kernels.log" -- "$PY" benchmarks/triton_kernels.py --device cpu --quick \
        --json "$OUT_DIR/triton_kernels.json"
else
    step triton_kernels 120 "$OUT_DIR/triton_kernels.log" -- "$PY" benchmarks/triton_kernels.py --device cuda \
        --presets tiny,small --widths 128 --json "$OUT_DIR/triton_kernels.json"
fi

# 4. Gemini capacity on the CUDA tier
if [ "$DRY" = "1" ]; then
    step gemini_capacity 120 "$OUT_DIR/gemini_capacity.log" -- "$PY" benchmarks/gemini_capacity.py --quick \
        --device cpu --out "$OUT_DIR/gemini_capacity_cpu.json"
else
    step gemini_capacity 60 "$OUT_DIR/gemini_capacity.log" -- "$PY" benchmarks/gemini_capacity.py --device cuda \
        --budget-mib 2048 --d 4096 --batch 2048 --steps 4 --threads 8 --out "$OUT_DIR/gemini_capacity_cuda.json"
fi

# 5. pretraining with the time left: `small` from scratch and, when GPU_RUN_INIT names an export
#    directory, that model continued beside it on the same GPU (two processes share the card, which
#    the first run's tiny / small models kept far from busy). GPU_RUN_ARGS is appended to both runs' flags,
#    GPU_RUN_INIT_ARGS to the continued one's; GPU_RUN_WORKERS data workers each (default 6). Each
#    run's --steps is sized from step 3's measured train step and the workers' episode rate, so its
#    cosine schedule ends inside the budget.
LEFT=$(( TOTAL - ($(date +%s) - START) - 60 ))
WORKERS="${GPU_RUN_WORKERS:-6}"
# blocks_of EXPORT_DIR: the model's block count, from its config.json
blocks_of() {
    "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['model']['n_layers'])" "$1/config.json"
}
# plan_steps PRESET BLOCKS SECONDS CELLS_PER_BATCH SHARERS: optimizer steps that fit SECONDS
plan_steps() {
    "$PY" - "$OUT_DIR/triton_kernels.json" "$@" "$WORKERS" <<'EOF'
import json, os, sys
path, preset = sys.argv[1], sys.argv[2]
blocks, seconds, cells, sharers, workers = map(float, sys.argv[3:])
# cells/s a run reaches whatever the card does: one worker builds ~0.2M cells/s of knn-linear episodes
# (CPU, measured), but the first H200 run (2026-12-04) trained at 55-100k cells/s with 6 or 14 workers
# alike (cause not found yet: the log's `data N%` says whether the loader is it)
data_rate = min(workers * 150e3, float(os.environ.get("GPU_RUN_CELLS_PER_S", 80e3)))
try:
    bench = json.load(open(path))["train_step_bf16"]
    shape, ms = bench["shape"], bench["presets"][preset]["torch"]["ms_per_step"]  # torch's ops: the default
    from tabfm.model import ModelConfig
    per_block = shape["tables"] * shape["rows"] * shape["cols"] / (ms * 1e-3) * ModelConfig.preset(preset).n_layers
    gpu_rate = per_block / blocks / sharers  # the card's share of this run
except (OSError, KeyError, ValueError, TypeError):
    gpu_rate = data_rate  # no measurement: the data rate alone
print(max(100, min(20000, int(0.7 * seconds * min(gpu_rate, data_rate) / cells))))
EOF
}
if [ "$DRY" = "1" ]; then
    step pretrain 240 "$OUT_DIR/pretrain.log" -- "$PY" -m tabfm.cli pretrain --preset smoke --precision bf16 \
        --device cpu --steps 6 --eval-every 3 --eval-batches 1 --no-sklearn-eval --no-progress --threads 1 \
        --max-minutes 2 --out "$OUT_DIR/smoke"
    echo "== plan_steps (rehearsal): tiny x4 blocks, 60 s -> $(plan_steps tiny 4 60 32768 1) steps; blocks of" \
        "tabfm-tiny-cf: $(blocks_of tabfm/weights/tabfm-tiny-cf)"
elif [ "$LEFT" -ge 90 ]; then
    MIN=$(awk -v s="$LEFT" 'BEGIN { printf "%.1f", (s - 40) / 60 }')
    RUN_SECONDS=$(( LEFT - 40 - 30 ))  # minus the start-up of the data workers and the store
    SHARERS=1
    [ -n "${GPU_RUN_INIT:-}" ] && SHARERS=2
    CELLS=32768  # pretrain-classes' cells per batch
    COMMON=(--precision bf16 --device cuda --max-minutes "$MIN" --no-sklearn-eval --no-progress --workers "$WORKERS"
            --stream pretrain-classes --context-features knn-linear --eval-every 500 --ckpt-every 500)
    # shellcheck disable=SC2206
    EXTRA=(${GPU_RUN_ARGS:-})
    if [ -n "${GPU_RUN_INIT:-}" ]; then
        BLOCKS=$(blocks_of "$GPU_RUN_INIT")
        INIT_STEPS=$(plan_steps tiny "$BLOCKS" "$RUN_SECONDS" "$CELLS" "$SHARERS")
        # shellcheck disable=SC2206
        INIT_EXTRA=(${GPU_RUN_INIT_ARGS:-})
        step pretrain_init $(( LEFT + 30 )) "$OUT_DIR/pretrain_init.log" -- "$PY" -m tabfm.cli pretrain \
            --n-layers "$BLOCKS" --init "$GPU_RUN_INIT" --steps "$INIT_STEPS" "${COMMON[@]}" "${EXTRA[@]}" \
            "${INIT_EXTRA[@]}" --out "$OUT_DIR/init" &
    fi
    SMALL_STEPS=$(plan_steps small 10 "$RUN_SECONDS" "$CELLS" "$SHARERS")
    step pretrain $(( LEFT + 30 )) "$OUT_DIR/pretrain.log" -- "$PY" -m tabfm.cli pretrain --preset small \
        --steps "$SMALL_STEPS" --warmup-steps $(( SMALL_STEPS / 10 )) "${COMMON[@]}" "${EXTRA[@]}" --out "$OUT_DIR/small"
    wait
else
    echo "== pretrain: skipped, only ${LEFT}s left" | tee "$OUT_DIR/pretrain.log"
    printf 'pretrain\tskipped\t0\t%s\n' "$OUT_DIR/pretrain.log" >> "$STEPS_FILE"
fi

# 6. summary
"$PY" - "$OUT_DIR" "$START" "$DRY" <<'EOF'
import json, sys, time
from pathlib import Path
out, start, dry = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, log = line.split("\t")
    steps[name] = {"exit": rc if rc == "skipped" else int(rc), "seconds": int(secs), "log": Path(log).name}
summary = {"dry_run": dry, "seconds": round(time.time() - start), "steps": steps,
           "ok": all(s["exit"] == 0 for s in steps.values())}
for name in ("versions.json", "triton_kernels.json", "gemini_capacity_cuda.json", "gemini_capacity_cpu.json"):
    p = out / name
    if p.exists():
        try:
            summary[name.removesuffix(".json")] = json.loads(p.read_text())
        except ValueError as err:
            summary[name.removesuffix(".json")] = f"unreadable: {err}"
for run in ("small", "init", "smoke"):
    export = out / run / "export"
    if export.exists():
        summary.setdefault("pretrain_export", []).extend(
            sorted(str(p.relative_to(out)) for p in export.rglob("*") if p.is_file()))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"== summary: ok={summary['ok']} in {summary['seconds']} s; " +
      ", ".join(f"{k}={v['exit']} ({v['seconds']} s)" for k, v in steps.items()) + f"; wrote {out / 'summary.json'}")
sys.exit(0 if summary["ok"] else 1)
EOF
RC=$?
# 7. with GPU_RUN_PACK=DIR (the device tool's $OUT, which takes back at most 8 files, 2 folders deep):
#    the logs and JSON in DIR/gpu_run.tgz (no checkpoints) and each run's export in DIR/<run>/
if [ -n "${GPU_RUN_PACK:-}" ]; then
    mkdir -p "$GPU_RUN_PACK"
    tar czf "$GPU_RUN_PACK/gpu_run.tgz" -C "$OUT_DIR" --exclude=checkpoints --exclude=export .
    for run in small init smoke; do
        if [ -d "$OUT_DIR/$run/export" ]; then
            mkdir -p "$GPU_RUN_PACK/$run" && cp "$OUT_DIR/$run/export/"* "$GPU_RUN_PACK/$run/"
        fi
    done
    echo "== packed into $GPU_RUN_PACK: $(cd "$GPU_RUN_PACK" && find . -type f | sort | tr '\n' ' ')"
fi
exit $RC
