"""tabfm's training engine: Booster + plugins, mixed precision, checkpoint IO. Imports torch only."""
from .booster import Booster
from .checkpoint import (
    CheckpointIO,
    CheckpointMeta,
    GeneralCheckpointIO,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
)
from .export import export_model, load_exported
from .plan import ParallelPlan
from .plugin import Plugin
from .plugins import SingleProcessPlugin
from .precision import DynamicLossScaler, MixedPrecision
from .state_io import load_state, save_state
from .wrappers import ModelWrapper, OptimizerWrapper

__all__ = [
    "Booster",
    "CheckpointIO",
    "CheckpointMeta",
    "DynamicLossScaler",
    "GeneralCheckpointIO",
    "MixedPrecision",
    "ModelWrapper",
    "OptimizerWrapper",
    "ParallelPlan",
    "Plugin",
    "SingleProcessPlugin",
    "checkpoint_dir",
    "export_model",
    "latest_checkpoint",
    "list_checkpoints",
    "load_exported",
    "load_state",
    "save_state",
]
