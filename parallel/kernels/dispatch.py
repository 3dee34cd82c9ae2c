"""When the model runs a Triton kernel instead of torch's op: decided once per process.

- Opt-in: only with ``TABFM_TRITON=1``. Measured on an H200 (BENCHMARKS.md, "The GPU run"),
  the kernels made a bf16 train step of tiny / small 1.4-1.5x slower than torch's eager ops,
  so torch's ops are the default until a kernel beats them.
- Only for plain (not DTensor) tensors on CUDA, outside `torch.compile` (inductor fuses these
  ops itself), when `triton` imports.
- Asked for on CUDA without a usable triton, the torch op runs, said once in a `RuntimeWarning`.
- CPU tensors always take torch's ops, with one exception for tests: ``TABFM_TRITON_CPU=1``
  together with ``TRITON_INTERPRET=1`` (triton's interpreter, fp32/fp16 only) and
  ``TABFM_TRITON=1`` routes CPU tensors to the kernels too. All must be set before triton is
  imported.

`decision()` caches the choice; `reset()` forgets it (tests change the environment).
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

ENV_SWITCH = "TABFM_TRITON"
CPU_TEST_SWITCH = "TABFM_TRITON_CPU"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "decision": (on, cpu_too, reason), "cpu_switch", "warned"


def _decide() -> tuple[bool, bool, str]:
    if os.environ.get(ENV_SWITCH, "0") != "1":
        return False, False, f"{ENV_SWITCH} is not 1 (the default: torch's ops)"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as err:  # ImportError, or a broken install
        return False, False, f"triton does not import ({type(err).__name__}: {err})"
    cpu_too = os.environ.get(CPU_TEST_SWITCH) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
    return True, cpu_too, ""


def decision() -> tuple[bool, bool, str]:
    """(kernels on, also on CPU tensors (interpret-mode tests), why off ('' when on))."""
    if "decision" not in _state:
        with _lock:
            if "decision" not in _state:
                _state["decision"] = _decide()
    return _state["decision"]  # type: ignore[return-value]


def enabled() -> bool:
    return decision()[0]


def reason() -> str:
    return decision()[2]


def reset() -> None:
    """Forget the decision and the warning (for tests that change the environment)."""
    _state.clear()


def use(*tensors: torch.Tensor | None) -> bool:
    """Whether to run a Triton kernel on these tensors (None entries are ignored): all plain
    tensors on one CUDA device (or CPU under the test switch), kernels on, not compiling."""
    if torch.compiler.is_compiling():  # inductor fuses these ops itself; first, so no guard on _state
        return False
    ts = [t for t in tensors if t is not None]
    if not ts or any(type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter for t in ts):
        return False
    dev = ts[0].device
    if any(t.device != dev for t in ts):
        return False
    if dev.type == "cuda":
        return _on_cuda()
    if dev.type == "cpu":  # the test switch is read once, without importing triton
        if "cpu_switch" not in _state:
            _state["cpu_switch"] = os.environ.get(CPU_TEST_SWITCH) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
        return bool(_state["cpu_switch"]) and decision()[1]
    return False


def _on_cuda() -> bool:
    """The choice for CUDA tensors; warns once where the kernels were asked for and triton is missing."""
    on, _, why = decision()
    if not on and not why.startswith(ENV_SWITCH) and not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(f"Triton kernels unavailable ({why}); RMSNorm + residual and GELU on CUDA use torch's "
                      "ops (same maths, more memory traffic)", RuntimeWarning, stacklevel=4)
    return on
