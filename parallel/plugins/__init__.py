"""Concrete plugins. Each one is a strategy; swapping plugins never changes the training loop."""
from .ddp import ReplicatedCheckpointReader, TorchDDPPlugin
from .fsdp import TorchFSDPPlugin
from .hybrid import HybridParallelPlugin
from .single import SingleProcessPlugin
from .zero import FullyShardPlugin, LowLevelZeroPlugin

__all__ = ["SingleProcessPlugin", "TorchDDPPlugin", "LowLevelZeroPlugin", "TorchFSDPPlugin", "FullyShardPlugin",
           "HybridParallelPlugin", "ReplicatedCheckpointReader"]
