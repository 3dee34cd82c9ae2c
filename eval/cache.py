"""Result cache: one JSON file per (dataset, protocol, method, versions).

The key holds the dataset name and content fingerprint, the protocol name (which carries its
version), the method name and a ``versions`` mapping (library versions, the method's own version
string such as a checkpoint hash). Any change in any of them is a miss, so reruns compute only
what is new. Files live at ``ROOT/<protocol task>/<dataset>/<method>-<key hash>.json`` and are
written atomically.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any


def cache_key(dataset: str, fingerprint: str, protocol: str, method: str, versions: dict[str, Any] | None) -> dict:
    return {
        "dataset": dataset,
        "fingerprint": fingerprint,
        "protocol": protocol,
        "method": method,
        "versions": {str(k): str(v) for k, v in sorted((versions or {}).items())},
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "_"


def _clean(o):
    """JSON-safe copy: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if hasattr(o, "item") and not isinstance(o, (str, bytes)):
        try:
            o = o.item()
        except (AttributeError, ValueError):
            pass
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _restore(o):
    """None metric values back to NaN (inverse of _clean for metric dicts)."""
    if isinstance(o, dict):
        return {k: (float("nan") if v is None else _restore(v)) for k, v in o.items()}
    if isinstance(o, list):
        return [_restore(v) for v in o]
    return o


class ResultCache:
    """``get(key)`` -> stored result or None; ``put(key, result)``. ``root=None`` disables caching."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None
        self.hits = 0
        self.misses = 0

    def path(self, key: dict) -> Path:
        task = key["protocol"].split("/")[0]
        return self.root / _safe(task) / _safe(key["dataset"]) / f"{_safe(key['method'])}-{key_hash(key)}.json"

    def get(self, key: dict) -> dict | None:
        if self.root is None:
            return None
        p = self.path(key)
        if not p.exists():
            self.misses += 1
            return None
        try:
            stored = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            self.misses += 1
            return None
        if stored.get("key") != key:  # hash collision or hand-edited file
            self.misses += 1
            return None
        self.hits += 1
        return _restore(stored["result"])

    def put(self, key: dict, result: dict) -> None:
        if self.root is None:
            return
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"key": key, "result": _clean(result)}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
