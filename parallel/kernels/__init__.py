"""Fused Triton kernels for the model's memory-bound work on CUDA (forward + backward each).

- `add_rms_norm` / `rms_norm` (`norm.py`): a block's residual add fused with the next
  sublayer's RMSNorm; `tabfm.model.block.BlockNorm` / `TableBlock` use it.
- `bias_gelu` (`gelu.py`): the MLP's (bias +) GELU; `tabfm.model.block.MLP` uses it.
- `target_log_prob` (`cross_entropy.py`): log-softmax over classes / bins gathered at the
  target, without keeping the softmax; not wired into the loss yet.

`dispatch.use(*tensors)` says whether a call runs them: opt-in with ``TABFM_TRITON=1`` (on an
H200 they were slower than torch's eager ops; BENCHMARKS.md), then on CUDA when triton imports
(torch's ops otherwise, with a one-time warning where triton is missing); never on CPU, except
for interpret-mode tests (``TRITON_INTERPRET=1`` and ``TABFM_TRITON_CPU=1``). Importing this package does not import triton; the wrappers below
import their kernel module on first call.
"""
from __future__ import annotations

from . import dispatch
from .dispatch import enabled, reason, use


def add_rms_norm(x, residual, weight, eps):
    from . import norm as _k
    return _k.add_rms_norm(x, residual, weight, eps)


def rms_norm(x, weight, eps):
    from . import norm as _k
    return _k.rms_norm(x, weight, eps)


def bias_gelu(h, bias=None, approximate="tanh"):
    from . import gelu as _k
    return _k.bias_gelu(h, bias, approximate)


def target_log_prob(logits, target):
    from . import cross_entropy as _k
    return _k.target_log_prob(logits, target)


__all__ = ["add_rms_norm", "bias_gelu", "dispatch", "enabled", "reason", "rms_norm", "target_log_prob", "use"]
