"""Pretraining on the synthetic stream: wires the model, the stream and the engine into a Trainer."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel import Booster, Plugin, SingleProcessPlugin, latest_checkpoint, load_exported
from synth.dataset import SynthDataset, SynthLoader
from synth.stream import StreamConfig
from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.train.config import PretrainConfig
from tabfm.train.evaluate import sklearn_eval, synthetic_eval
from tabfm.train.optim import build_optimizer, warmup_cosine
from tabfm.train.trainer import Trainer, TrainResult

# the header of config.json in an export: what estimators need to rebuild the model
EXPORT_FORMAT = "tabfm.model"


def export_config(model_cfg: ModelConfig, train_cfg: PretrainConfig, **info) -> dict:
    return {"format": EXPORT_FORMAT, "version": 1, "model": model_cfg.to_dict(), "train": train_cfg.to_dict(), **info}


def _check_same_run(out: Path, cfg: PretrainConfig) -> None:
    """Resuming with a different model or stream would silently mix runs: refuse."""
    saved_path = out / "train_config.json"
    if not saved_path.exists():
        return
    saved = json.loads(saved_path.read_text())
    for key in ("model", "stream", "seed", "optimizer"):
        if saved.get(key) != getattr(cfg, key):
            raise ValueError(
                f"{out} holds a run with {key}={saved.get(key)!r}, this one has {key}={getattr(cfg, key)!r}; "
                "use another --out or the same settings to resume"
            )


def warm_start(model: TabFM, init: str) -> None:
    """Copy weights from an export (path or shipped name) into `model`; the model configs must agree."""
    from tabfm.weights import resolve_model_path  # the estimator-side loader knows shipped names

    path = resolve_model_path(init)
    state, header = load_exported(path)
    theirs = ModelConfig.from_dict(header["model"]).to_dict() if "model" in header else None
    if theirs != model.config.to_dict():
        diff = {k: (v, (theirs or {}).get(k)) for k, v in model.config.to_dict().items() if (theirs or {}).get(k) != v}
        raise ValueError(f"--init {init}: its model config differs from this run's (field: (this run, init)): {diff}")
    model.load_state_dict(state, strict=True)


def pretrain(cfg: PretrainConfig, out_dir: str | Path, plugin: Plugin | None = None, progress: bool = True) -> TrainResult:
    """Pretrain (or resume, when out_dir holds checkpoints) and export to out_dir/export."""
    out = Path(out_dir)
    _check_same_run(out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model_cfg = ModelConfig.preset(cfg.model)
    model = TabFM(model_cfg)
    if cfg.init is not None and latest_checkpoint(out / "checkpoints") is None:
        warm_start(model, cfg.init)
    optimizer = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
    booster = Booster(plugin or SingleProcessPlugin(device=cfg.device), precision=cfg.precision)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)

    stream_cfg = StreamConfig.preset(cfg.stream)
    plug = booster.plugin
    dataset = SynthDataset(stream_cfg, seed=cfg.seed, rank=plug.dp_rank, world_size=plug.dp_world_size)
    data = SynthLoader(dataset, num_workers=cfg.workers)

    evaluators = {}
    if cfg.eval_batches > 0:
        evaluators["synth"] = synthetic_eval(stream_cfg, cfg.seed, cfg.eval_batches)
    if cfg.eval_sklearn:
        evaluators["sklearn"] = sklearn_eval()

    trainer = Trainer(
        booster, model, optimizer, scheduler, masked_cell_loss, data, out,
        steps=cfg.steps, grad_accum=cfg.grad_accum, clip=cfg.clip, log_every=cfg.log_every,
        ckpt_every=cfg.ckpt_every, keep_last=cfg.keep_last, max_minutes=cfg.max_minutes,
        evaluators=evaluators, eval_every=cfg.eval_every,
        export_config=export_config(model_cfg, cfg, preset=cfg.model), progress=progress and plug.is_main_process,
    )
    start = trainer.resume()
    if start and progress:
        print(f"resuming {out} from step {start}")
    return trainer.fit()
