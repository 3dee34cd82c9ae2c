"""Locating and loading TabFM weights: a shipped name ("tabfm-tiny-cf") or an export directory.

An export directory holds exactly `model.safetensors` + `config.json` (written by
`tabfm.parallel.export_model`, header from `tabfm.train.pretrain.export_config`). Shipped weights
live in `tabfm/weights/<name>/`. Loaded models are cached per process, keyed by the resolved
directory, the weights file's size and modification time, and the device, so estimators that
share a model share one copy and a re-exported directory is picked up.
"""
from __future__ import annotations

from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the model load with the first model, not with the names below
    import torch

    from tabfm.model import TabFM

SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
SHIPPED_MODELS = ("tabfm-tiny", "tabfm-tiny-cf")  # -cf: pretrained with context features (docs/estimators.md)
# Each task's default weights, the ones measured best for it on the public suites (docs/evaluation.md):
# tabfm-tiny-cf classifies in one pass with its own neighbour and ridge columns, imputes better and,
# predicting the regressor's ridge residual, regresses better; tabfm-tiny's detector stays ahead.
DEFAULT_MODELS = {"classification": "tabfm-tiny-cf", "regression": "tabfm-tiny-cf",
                  "imputation": "tabfm-tiny-cf", "anomaly": "tabfm-tiny"}
DEFAULT_MODEL = DEFAULT_MODELS["classification"]  # where no task is named (load_model, tabfm export --onnx)
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
EXPORT_FORMAT, EXPORT_VERSION = "tabfm.model", 1


class ModelNotFoundError(FileNotFoundError):
    """No usable weights where a model name or path points."""


def _listing(path: Path) -> str:
    """What a directory holds, for error messages."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a directory"
    names = sorted(p.name for p in path.iterdir())
    return f"it holds {names[:10]}{' ...' if len(names) > 10 else ''}" if names else "it is empty"


def shipped_names() -> list[str]:
    """Names of shipped models that are installed (have both files)."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / WEIGHTS_FILE).is_file() and (p / CONFIG_FILE).is_file())


def resolve_model_path(model: str | PathLike) -> Path:
    """The export directory a shipped name or a path points to; ModelNotFoundError saying what is there."""
    text = str(model)
    path = Path(text).expanduser()
    is_name = not path.is_dir() and "/" not in text and "\\" not in text and not text.startswith(".")
    if is_name:
        if text not in SHIPPED_MODELS and not (SHIPPED_DIR / text).is_dir():
            raise ModelNotFoundError(
                f"model {text!r} is neither an export directory nor a shipped model name "
                f"(shipped: {list(SHIPPED_MODELS)}; installed in {SHIPPED_DIR}: {shipped_names()})")
        path = SHIPPED_DIR / text
        where = f"shipped model {text!r} ({path})"
    else:
        where = f"model directory {str(path)!r}"
    missing = [f for f in (WEIGHTS_FILE, CONFIG_FILE) if not (path / f).is_file()]
    if missing:
        hint = " (the shipped weights are not installed yet: pass the path of an export directory)" if is_name else ""
        raise ModelNotFoundError(f"{where} lacks {missing}: {_listing(path)}{hint}")
    return path.resolve()


def build_model(state_dict: dict[str, torch.Tensor], config: dict, where: str = "export") -> TabFM:
    """A TabFM in eval mode from an export's state dict and config.json dict; ValueError naming the problem."""
    from tabfm.model import ModelConfig, TabFM

    if config.get("format") != EXPORT_FORMAT or config.get("version") != EXPORT_VERSION:
        raise ValueError(f"{where}: config.json is not a {EXPORT_FORMAT} v{EXPORT_VERSION} export "
                         f"(format={config.get('format')!r}, version={config.get('version')!r})")
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{where}: config.json has no 'model' section (a ModelConfig dict)")
    model = TabFM(ModelConfig.from_dict(config["model"]))
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{where}: weights do not match the config's architecture: {err}") from None
    model.eval()
    model.requires_grad_(False)
    return model


@lru_cache(maxsize=8)
def _load_cached(path: str, size: int, mtime_ns: int, device: str) -> TabFM:
    from tabfm.parallel import load_exported

    state_dict, config = load_exported(path)
    return build_model(state_dict, config, where=path).to(device)


def load_model(model: str | PathLike = DEFAULT_MODEL, device: str | torch.device = "cpu") -> TabFM:
    """The TabFM that `model` (shipped name or export directory) names, on `device`, cached per process.

    The returned module is shared between callers: do not modify it (use it in eval mode).
    """
    import torch

    path = resolve_model_path(model)
    stat = (path / WEIGHTS_FILE).stat()
    return _load_cached(str(path), stat.st_size, stat.st_mtime_ns, str(torch.device(device)))
