"""Pretraining on the synthetic stream or a table store: wires the model, the data and the engine into a Trainer.

One process (`--plugin single | gemini`) or many under torchrun (`--plugin ddp | zero | fsdp | hybrid | gemini`): every
rank builds the same model, draws its data-parallel rank's share of the stream, and runs the same
loop (the criterion goes through `booster.boost`, so row-sharded losses are reduced); the
main process (rank 0) writes train_config.json, logs and metrics. Checkpoints and the export
are written collectively by the plugin's checkpoint IO.

With `PretrainConfig.data` (`--data STORE`) the batches come from a table store instead
(`tabfm.data.store_episodes.StoreEpisodes`: bucketed batches of store tables, one episode per table,
each data-parallel rank its own tables, epochs one after another). train_config.json then also
records the store (`data_store`: resolved path, header fingerprint, tables), and a run is
resumed only on the same store. The held-out synthetic evaluation is kept: it measures the
prior, comparable across runs whatever they were trained on.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tabfm.parallel import Booster, Plugin, SingleProcessPlugin, latest_checkpoint, load_exported
from tabfm.parallel.checkpoint import MANIFEST, read_manifest
from tabfm.parallel.export import export_model
from tabfm.parallel.launch import barrier, launch
from tabfm.parallel.state_io import read_json, write_json
from tabfm.data.store_episodes import StoreEpisodes, open_store, store_fingerprint
from tabfm.data.table_episodes import EpisodeConfig
from tabfm.synth.dataset import SynthDataset, SynthLoader
from tabfm.synth.stream import StreamConfig
from tabfm.model import ModelConfig, TabFM, masked_cell_loss
from tabfm.model.growth import add_context_refs, drop_context_refs, group_cells, grow_depth
from tabfm.train.config import PretrainConfig, resolve_precision, run_model_config
from tabfm.train.evaluate import sklearn_eval, synthetic_eval
from tabfm.train.mixed_data import MixedBatches
from tabfm.train.optim import build_optimizer, warmup_cosine
from tabfm.train.trainer import Trainer, TrainResult

# the header of config.json in an export: what estimators need to rebuild the model
EXPORT_FORMAT = "tabfm.model"
TRAIN_CONFIG = "train_config.json"


def export_config(model_cfg: ModelConfig, train_cfg: PretrainConfig | dict[str, Any], **info: Any) -> dict:
    """The config.json header of an export; `train_cfg` may be the dict a run saved in train_config.json."""
    train = train_cfg.to_dict() if isinstance(train_cfg, PretrainConfig) else dict(train_cfg)
    return {"format": EXPORT_FORMAT, "version": 1, "model": model_cfg.to_dict(), "train": train, **info}


# --------------------------------------------------------------------------- the engine plugin

def build_plugin(cfg: PretrainConfig) -> Plugin:
    """The plugin `cfg.plugin` names. Distributed plugins first join the process group that
    torchrun describes (`tabfm.parallel.launch`: gloo on CPU, NCCL on CUDA); the caller owns it and
    calls `tabfm.parallel.destroy()` at the end."""
    world = os.environ.get("WORLD_SIZE")
    if cfg.plugin == "gemini":  # one process, or its chunks sharded over the ranks torchrun starts
        from tabfm.parallel.gemini import GeminiPlugin

        if world is not None:
            launch()
        options = cfg.gemini_options()
        if options["device"] != "cpu" and os.environ.get("LOCAL_RANK") is not None:
            import torch

            if torch.cuda.is_available():  # one GPU per local rank
                options["device"] = f"cuda:{os.environ['LOCAL_RANK']}"
        return GeminiPlugin(**options)
    if cfg.plugin == "single":
        if world is not None and int(world) > 1:
            raise ValueError(f"--plugin single under torchrun with WORLD_SIZE={world}: every process would train "
                             "its own copy; use --plugin ddp, zero or fsdp")
        return SingleProcessPlugin(device=cfg.device)
    if world is None:
        raise ValueError(f"--plugin {cfg.plugin} runs one process per rank under torchrun: "
                         f"torchrun --nproc_per_node N -m tabfm.cli pretrain --plugin {cfg.plugin} ... "
                         "(or --plugin single for one process)")
    launch()
    if cfg.plugin == "ddp":
        from tabfm.parallel.plugins.ddp import TorchDDPPlugin

        return TorchDDPPlugin(device=cfg.device)
    if cfg.plugin == "zero":
        from tabfm.parallel.plugins.zero import LowLevelZeroPlugin

        return LowLevelZeroPlugin(stage=cfg.zero_stage or 1, device=cfg.device)
    if cfg.plugin == "hybrid":
        from tabfm.parallel.plugins.hybrid import HybridParallelPlugin

        return HybridParallelPlugin(tp_size=cfg.tp, sp_size=cfg.sp, pp_size=cfg.pp, ep_size=cfg.ep,
                                    zero_stage=cfg.zero_stage or 0,
                                    device=cfg.device,
                                    num_microbatches=cfg.microbatches if cfg.pp > 1 else None)
    from tabfm.parallel.plugins.fsdp import TorchFSDPPlugin

    return TorchFSDPPlugin(device=cfg.device)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --------------------------------------------------------------------------- resuming safely

def _check_same_run(out: Path, cfg: PretrainConfig, store: dict[str, Any] | None = None) -> None:
    """Refuse what would silently mix runs: resuming with a different model, stream, seed,
    optimizer or training data (synthetic stream vs a table store; another store path, or a store
    whose headers changed; other store batch sizes). Another plugin or world size is fine for the
    synthetic stream: every plugin's checkpoint IO reads both formats ("general" full tensors and
    "sharded" DCP shards) and reshards on load (a store run keeps its data-parallel ranks)."""
    saved_path = out / TRAIN_CONFIG
    if saved_path.exists():
        saved = read_json(saved_path)
        defaults = {"cells_per_token": 1, "context_features": "none", "context_refs": False, "microbatches": 1,
                    "moe_experts": 0, "moe_top_k": 1, "lr_scale": {}}
        for key in ("model", "cells_per_token", "n_layers", "stream", "seed", "optimizer", "context_features",
                    "context_refs", "microbatches", "moe_experts", "moe_top_k", "lr_scale"):
            if saved.get(key, defaults.get(key)) != getattr(cfg, key):
                raise ValueError(
                    f"{out} holds a run with {key}={saved.get(key)!r}, this one has {key}={getattr(cfg, key)!r}; "
                    "use another --out or the same settings to resume"
                )
        _check_same_data(out, saved, cfg, store)


def _data_name(store: dict[str, Any] | None) -> str:
    return "the synthetic stream" if store is None else f"table store {store.get('path')}"


def _check_same_data(out: Path, saved: dict[str, Any], cfg: PretrainConfig, store: dict[str, Any] | None) -> None:
    before = (saved.get("data_store") or {"path": saved.get("data")}) if saved.get("data") is not None else None
    if (before is None) != (store is None):
        raise ValueError(f"{out} holds a run trained on {_data_name(before)}, this one trains on {_data_name(store)}; "
                         "use another --out or the same --data to resume")
    if store is None:
        return
    if before.get("path") != store["path"]:
        raise ValueError(f"{out} holds a run trained on table store {before.get('path')}, this one trains on "
                         f"{store['path']}; use another --out or the same --data to resume")
    if before.get("fingerprint") != store["fingerprint"]:
        raise ValueError(f"{out} holds a run trained on table store {store['path']} when its tables had header "
                         f"fingerprint {before.get('fingerprint')} ({before.get('tables')} tables); the store now has "
                         f"{store['fingerprint']} ({store['tables']} tables): tables were added, removed or replaced. "
                         "Use another --out, or restore the store to resume")
    for key in ("data_share", "data_cells_per_batch", "data_max_batch"):
        if saved.get(key) != getattr(cfg, key):
            raise ValueError(f"{out} holds a run with {key}={saved.get(key)!r}, this one has {key}={getattr(cfg, key)!r}; "
                             "use another --out or the same settings to resume")


def announce_resume(out: Path, trainer: Trainer, plugin: Plugin) -> None:
    """Say where the run resumes (main process) and record it in the metrics."""
    ckpt, step = trainer.resumed_from, trainer.step
    saved = read_manifest(ckpt).get("layout", {})
    before, now = int(saved.get("world_size", 1)), _world_size()
    dp_before, dp_now = int(saved.get("dp", before)), plugin.dp_world_size
    trainer.record("resume", {"checkpoint": ckpt.name, "world_size": now, "checkpoint_world_size": before})
    if plugin.is_main_process:
        print(f"resuming {out} from step {step} ({ckpt.name})", flush=True)
        if dp_before != dp_now:
            print(f"  data-parallel ranks: {dp_before} -> {dp_now}; the global batch changes by {dp_now}/{dp_before}",
                  flush=True)


# --------------------------------------------------------------------------- pretraining

def warm_start(model: TabFM, init: str) -> None:
    """Copy weights from an export (path or shipped name) into `model`; the model configs must agree,
    except that `model` may have more blocks (the init's blocks are repeated), from a G = 1 init,
    more cells per token, context references the init lacks, and none where this run drops the
    context features (tabfm.model.growth)."""
    from tabfm.weights import resolve_model_path  # the estimator-side loader knows shipped names

    path = resolve_model_path(init)
    state, header = load_exported(path)
    theirs = ModelConfig.from_dict(header["model"]).to_dict() if "model" in header else {}
    ours = model.config.to_dict()
    diff = {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v}
    diff.pop("context_features", None)  # an input contract, not weights: a run may teach the init new columns
    if "cells_per_token" in diff and theirs.get("cells_per_token") == 1:
        state = group_cells(state, ours["d_model"], ours["cells_per_token"])
        diff.pop("cells_per_token")
    if diff.get("context_refs") == (True, False):  # the init learns what its feature columns estimate
        state = add_context_refs(state, ours["d_model"], ours["id_dim"])
        diff.pop("context_refs")
    elif diff.get("context_refs") == (False, True) and ours["context_features"] == "none":  # nothing to refer to
        state = drop_context_refs(state)
        diff.pop("context_refs")
    if set(diff) == {"n_layers"} and theirs["n_layers"] < ours["n_layers"]:
        state = grow_depth(state, theirs["n_layers"], ours["n_layers"])
    elif diff:
        hint = "; only a deeper run (--n-layers above the init's) can start from it" if "n_layers" in diff else ""
        raise ValueError(f"--init {init}: its model config differs from this run's (field: (this run, init)): "
                         f"{diff}{hint}")
    model.load_state_dict(state, strict=True)


def start_over(out: Path) -> list[Path]:
    """Remove a run's checkpoints and logs (`--restart`: starting over on purpose); return what went."""
    import shutil

    gone = [p for p in (out / "checkpoints", out / "metrics.jsonl", out / "tb") if p.exists()]
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return gone


def pretrain(cfg: PretrainConfig, out_dir: str | Path, plugin: Plugin | None = None, progress: bool = True,
             restart: bool = False, bar: bool | None = None) -> TrainResult:
    """Pretrain (or resume, when out_dir holds checkpoints) and export to out_dir/export.

    `plugin` defaults to `build_plugin(cfg)`. `restart` removes out_dir's checkpoints and logs
    first (a run that must not resume). `progress` prints status messages and the training log;
    `bar` draws the progress bar (None: with `progress`, when stderr is a terminal; see Trainer).
    Under torchrun call this on every rank."""
    out = Path(out_dir)
    plug = plugin if plugin is not None else build_plugin(cfg)
    main = plug.is_main_process
    if restart:
        if main:
            for p in start_over(out):
                print(f"--restart: removed {p}", flush=True)
        barrier()
    model_cfg = run_model_config(cfg)
    stream_cfg = StreamConfig.preset(cfg.stream, context_features=cfg.context_features,
                                     table_multiple=cfg.microbatches)
    headers = store = None
    if cfg.data is not None:  # a store that is missing, empty or unreadable fails here, before anything is written
        headers = open_store(cfg.data)
        store = {"path": str(Path(cfg.data).resolve()), "fingerprint": store_fingerprint(headers),
                 "tables": len(headers)}
    if not restart:
        _check_same_run(out, cfg, store)  # every rank reads the old train_config.json ...
    barrier()  # ... before the main process replaces it
    if main:
        out.mkdir(parents=True, exist_ok=True)
        record = cfg.to_dict()
        if store is not None:
            record["data_store"] = store
        write_json(out / TRAIN_CONFIG, record)  # atomic: a kill mid-write must not block the resume

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # the same initial model on every rank
    model = TabFM(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.init is not None and latest_checkpoint(out / "checkpoints") is None:
        warm_start(model, cfg.init)
    optimizer = build_optimizer(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, muon_lr=cfg.muon_lr,
                                lr_scale=cfg.lr_scale)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
    precision = resolve_precision(cfg.precision, plug.device)
    if main and progress and precision != cfg.precision:
        print(f"pretrain {out}: precision {cfg.precision} -> {precision} on {plug.device}", flush=True)
    booster = Booster(plug, precision=precision, activation_checkpointing=cfg.activation_checkpointing,
                      compile=cfg.compile)  # the plugin applies both at their place in parallelize's order
    model, optimizer, criterion, _, scheduler = booster.boost(model, optimizer, masked_cell_loss,
                                                              lr_scheduler=scheduler)

    synthetic = store_batches = None
    if cfg.data is None or (cfg.data_share or 1.0) < 1.0:
        dataset = SynthDataset(stream_cfg, seed=cfg.seed, rank=plug.dp_rank, world_size=plug.dp_world_size,
                               micro_batches=cfg.grad_accum)
        synthetic = SynthLoader(dataset, num_workers=cfg.workers)
    if cfg.data is not None:
        store_batches = store_data(cfg, headers, plug.dp_rank, plug.dp_world_size, model_cfg.max_categories)
    if synthetic is not None and store_batches is not None:
        data = MixedBatches(synthetic, store_batches, cfg.data_share, cfg.seed)
    else:
        data = synthetic if synthetic is not None else store_batches
    cells = stream_cfg.cells_per_batch if store_batches is None else store_batches.sampler.cells_per_batch

    # every rank evaluates (a sharded forward is collective); the main process logs
    evaluators = {}
    if cfg.eval_batches > 0:
        evaluators["synth"] = synthetic_eval(stream_cfg, cfg.seed, cfg.eval_batches)
    if cfg.eval_sklearn:
        evaluators["sklearn"] = sklearn_eval(context_features=cfg.context_features)

    trainer = Trainer(
        booster, model, optimizer, scheduler, criterion, data, out,
        steps=cfg.steps, grad_accum=cfg.grad_accum, microbatches=cfg.microbatches, clip=cfg.clip, log_every=cfg.log_every,
        ckpt_every=cfg.ckpt_every, keep_last=cfg.keep_last, max_minutes=cfg.max_minutes,
        evaluators=evaluators, eval_every=cfg.eval_every,
        export_config=export_config(model_cfg, cfg, preset=cfg.model), progress=progress, seed=cfg.seed,
        max_bad_steps=cfg.max_bad_steps, bar=bar,
    )
    if main and progress and cfg.data is not None:
        share = "" if synthetic is None else f"; {cfg.data_share:.0%} of the batches, the rest synthetic"
        print(f"pretrain {out}: table store {store['path']}, {store['tables']} tables, {store_batches.batches_per_epoch} "
              f"batches per epoch and data-parallel rank{share}", flush=True)
    if main and progress and plug.dp_world_size > 1:
        print(f"pretrain {out}: plugin {plug.name}, {_world_size()} processes, {plug.dp_world_size} data-parallel "
              f"ranks x ~{cells:,} cells per micro-batch each", flush=True)
    if main and progress and plug.layout().get("tp", 1) * plug.layout().get("sp", 1) > 1:
        layout = plug.layout()
        print(f"pretrain {out}: each table split over tp={layout['tp']} x sp={layout['sp']} ranks", flush=True)
    resumed = trainer.resume()
    if resumed:
        announce_resume(out, trainer, plug)
    if main and progress:
        print(f"pretrain {out}: {f'resumed at step {trainer.step}' if resumed else 'fresh run'} of {cfg.steps} steps; "
              f"plugin {plug.name}, {_world_size()} process(es); model {cfg.model} ({n_params / 1e6:.2f}M parameters, "
              f"{model_cfg.n_layers} blocks, d_model {model_cfg.d_model}); {cfg.optimizer}, {precision}", flush=True)
    return trainer.fit()


def store_data(cfg: PretrainConfig, headers: Any, rank: int, world_size: int, max_classes: int) -> StoreEpisodes:
    """The training data of `cfg.data`: episode batches of the store's tables for data-parallel rank `rank`.

    Batches hold at most data_cells_per_batch padded cells and data_max_batch tables (default: the
    stream preset's cells_per_batch / max_batch); episodes follow tabfm.data.table_episodes.EpisodeConfig's
    defaults (20 % imputation, ordinal categorical features) with the model's head width as max_classes
    and the stream preset's imputation masks (mask_fraction, mask_mechanisms) and residual_targets."""
    stream_cfg = StreamConfig.preset(cfg.stream)
    cells = cfg.data_cells_per_batch if cfg.data_cells_per_batch is not None else stream_cfg.cells_per_batch
    max_batch = cfg.data_max_batch if cfg.data_max_batch is not None else stream_cfg.max_batch
    episodes = EpisodeConfig(max_classes=max_classes, context_features=cfg.context_features,
                             mask_fraction=stream_cfg.mask_fraction, mask_mechanisms=stream_cfg.mask_mechanisms,
                             residual_targets=stream_cfg.residual_targets)
    return StoreEpisodes(cfg.data, episodes, cells_per_batch=cells, max_batch=max_batch,
                         seed=cfg.seed, world_size=world_size, rank=rank, num_workers=cfg.workers, headers=headers)


# --------------------------------------------------------------------------- export from a checkpoint

def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: a checkpoint directory itself, or the newest complete one of a
    run directory (under its checkpoints/) or of a checkpoints directory."""
    p = Path(path)
    if not p.is_dir():
        what = "not a directory" if p.exists() else "no such directory"
        raise ValueError(f"{p}: {what} (expected a checkpoint or a run directory)")
    if (p / MANIFEST).is_file():
        return p
    for root in (p / "checkpoints", p):
        ckpt = latest_checkpoint(root)
        if ckpt is not None:
            return ckpt
    raise ValueError(f"{p} is neither a checkpoint (no {MANIFEST}) nor a run directory with a complete "
                     "checkpoint under checkpoints/")


def checkpoint_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full model weights of a checkpoint ("general" or "sharded") in one process, whatever world size wrote it."""
    from tabfm.parallel.sharded_checkpoint import load_full_model_state

    return load_full_model_state(ckpt)


def run_train_config(ckpt: Path, train_config: str | Path | None = None) -> dict[str, Any]:
    """The train_config.json of the run a checkpoint belongs to (RUN/checkpoints/step_N -> RUN)."""
    candidates = [Path(train_config)] if train_config is not None else [ckpt.parent.parent / TRAIN_CONFIG,
                                                                       ckpt.parent / TRAIN_CONFIG]
    for path in candidates:
        if path.is_file():
            saved = read_json(path)
            finetuned = isinstance(saved, dict) and saved.get("recipe") == "finetune"  # its model: the init's
            if not isinstance(saved, dict) or not (finetuned or isinstance(saved.get("model"), str)):
                raise ValueError(f"{path}: not a pretraining train_config.json (no model preset name)")
            return saved
    raise ValueError(f"cannot find the run's {TRAIN_CONFIG} for {ckpt} (looked at {', '.join(map(str, candidates))}); "
                     "pass its path with --train-config")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path,
                      train_config: str | Path | None = None) -> tuple[Path, Path]:
    """Write `out_dir/model.safetensors` + `config.json` from a checkpoint (or a run's newest one),
    exactly as the run's own export at that step; return (checkpoint used, out_dir)."""
    ckpt = find_checkpoint(checkpoint)
    state = checkpoint_model_state(ckpt)
    train = run_train_config(ckpt, train_config)
    if train.get("recipe") == "finetune":
        from tabfm.train.finetune import checkpoint_model  # the init's model, adapters merged

        model, model_cfg, transform = checkpoint_model(train, state, ckpt)
        return ckpt, export_model(model, out_dir, export_config(model_cfg, train, preset=train["model"]), transform)
    model_cfg = run_model_config(train)
    model = TabFM(model_cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{ckpt}: weights do not match model preset {train['model']!r}: {err}") from None
    return ckpt, export_model(model, out_dir, export_config(model_cfg, train, preset=train["model"]))
