"""Concrete plugins. Each one is a strategy; swapping plugins never changes the training loop."""
from .ddp import ReplicatedCheckpointIO, TorchDDPPlugin
from .single import SingleProcessPlugin
from .zero import LowLevelZeroPlugin

__all__ = ["SingleProcessPlugin", "TorchDDPPlugin", "LowLevelZeroPlugin", "ReplicatedCheckpointIO"]
