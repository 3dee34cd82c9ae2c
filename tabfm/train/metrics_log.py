"""MetricsLog: one JSON line per record, mirrored to TensorBoard when it is installed."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _drop_partial_line(path: Path) -> None:
    """Cut a half-written last record (a run killed mid-write), so appended records stay readable."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class MetricsLog:
    """Append-only JSONL metrics (`metrics.jsonl`); TensorBoard scalars under `tb/` if available.

    One writer per run: under torchrun only the main process opens it. A resumed run first drops
    the records after the step it resumes from (`truncate_after`: steps redone after a crash are
    logged once), then appends (a "resume" record marks where). TensorBoard event files are only
    appended to; their viewers show the redone steps' latest values."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                self._tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except ImportError:
                self._tb = None

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
        self._file.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps after `step` (rewritten atomically); return how many went."""
        self._file.close()
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        return len([line for line in lines if line.strip()]) - len(kept)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
