"""tabfm's training engine: Booster + plugins, mixed precision, checkpoint IO. Imports torch only."""
from .activation_checkpointing import checkpoint_blocks
from .booster import Booster
from .compile import compile_blocks
from .checkpoint import (
    CheckpointIO,
    CheckpointMeta,
    GeneralCheckpointReader,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
)
from .export import export_model, load_exported
from .gemini import DeviceBudgetError, GeminiPlugin
from .launch import DistInfo, destroy, launch, seed_for_rank
from .mesh import MeshSpec, build_mesh, resolve_mesh_spec
from .parallelize import Parallelized, parallelize
from .plan import ParallelPlan, plan_of
from .plugin import Plugin
from .plugins import (
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    ReplicatedCheckpointReader,
    SingleProcessPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from .precision import DynamicLossScaler, MixedPrecision
from .state_io import load_state, save_state
from .wrappers import ModelWrapper, OptimizerWrapper

__all__ = [
    "Booster",
    "CheckpointIO",
    "CheckpointMeta",
    "DynamicLossScaler",
    "GeneralCheckpointReader",
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
    "HybridParallelPlugin",
    "DeviceBudgetError", "GeminiPlugin",
    "DistInfo", "LowLevelZeroPlugin", "MeshSpec", "ReplicatedCheckpointReader", "TorchDDPPlugin", "TorchFSDPPlugin",
    "Parallelized", "build_mesh", "checkpoint_blocks", "compile_blocks", "destroy", "launch", "parallelize", "plan_of",
    "resolve_mesh_spec", "seed_for_rank",
]
