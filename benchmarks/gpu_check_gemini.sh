#!/usr/bin/env bash
# GPU check of GeminiPlugin's CUDA device tier (issue #6), for one CUDA GPU, about 5 minutes.
#
#   bash benchmarks/gpu_check_gemini.sh            # results under $OUT if set, else
#                                                   # benchmarks/results/gpu_check_gemini/
#
# 1. prints python / torch / CUDA / GPU versions; exits 2 at once if torch sees no CUDA GPU;
# 2. pytest tests/test_gemini_cuda.py (CUDA equality with the no-offload reference for every
#    placement, the budget against torch.cuda.max_memory_allocated, prefetch overlap) and
#    tests/test_gemini.py (the CPU tier, unchanged) -> pytest_cuda.log, pytest_cuda.xml;
#    fails if any CUDA test was skipped;
# 3. benchmarks/gemini_capacity.py --device cuda (2 GiB device budget, Linear(4096, 4096) layers,
#    batch 2048) -> gemini_capacity_cuda.json, gemini_capacity_cuda.log;
# 4. summary.json: versions, each stage's exit status, and "ok".
# Exit status: 0 only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results/gpu_check_gemini}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
PY="${PYTHON:-python}"

echo "== versions"
if ! "$PY" - "$OUT_DIR/versions.json" <<'EOF'
import json, platform, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())
print(json.dumps(info, indent=1))
open(sys.argv[1], "w").write(json.dumps(info, indent=1))
sys.exit(0 if info["cuda_available"] else 2)
EOF
then
    echo "FAIL: torch sees no CUDA GPU; this check needs one (see versions above)" >&2
    echo '{"ok": false, "reason": "torch sees no CUDA GPU"}' > "$OUT_DIR/summary.json"
    exit 2
fi

echo "== pytest (CUDA tests + the CPU tier)"
timeout 180 "$PY" -m pytest -q -rsf -p no:cacheprovider tests/test_gemini_cuda.py tests/test_gemini.py \
    --junitxml "$OUT_DIR/pytest_cuda.xml" 2>&1 | tee "$OUT_DIR/pytest_cuda.log"
TESTS=${PIPESTATUS[0]}
if grep -q "needs a CUDA GPU" "$OUT_DIR/pytest_cuda.log"; then
    echo "FAIL: CUDA tests were skipped although a GPU is visible" >&2
    TESTS=3
fi
[ "$TESTS" -eq 0 ] || echo "FAIL: pytest exited $TESTS (see $OUT_DIR/pytest_cuda.log)" >&2

echo "== capacity benchmark (device tier = CUDA)"
timeout 240 "$PY" benchmarks/gemini_capacity.py --device cuda --budget-mib 2048 --d 4096 --batch 2048 --steps 4 \
    --threads 8 --out "$OUT_DIR/gemini_capacity_cuda.json" 2>&1 | tee "$OUT_DIR/gemini_capacity_cuda.log"
BENCH=${PIPESTATUS[0]}
[ "$BENCH" -eq 0 ] || echo "FAIL: benchmark exited $BENCH (see $OUT_DIR/gemini_capacity_cuda.log)" >&2

"$PY" - "$OUT_DIR" "$TESTS" "$BENCH" <<'EOF'
import json, sys
from pathlib import Path
out, tests, bench = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"versions": json.loads((out / "versions.json").read_text()), "pytest_exit": tests, "benchmark_exit": bench,
           "ok": tests == 0 and bench == 0}
cap = out / "gemini_capacity_cuda.json"
if cap.exists():
    summary["capacity"] = json.loads(cap.read_text())
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"== summary: ok={summary['ok']} (pytest exit {tests}, benchmark exit {bench}); wrote {out / 'summary.json'}")
EOF
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
