"""Gemini: chunk-based heterogeneous memory (device budget, host, disk), sharded over ranks."""
from .chunks import Chunk, ChunkManager, TensorState, choose_chunk_size
from .comm import ShardComm
from .optim import GeminiOptimizer
from .placement import AutoPolicy, LRUPolicy
from .plugin import GeminiPlugin
from .tiers import DeviceBudget, DeviceBudgetError, DiskStore

__all__ = ["AutoPolicy", "Chunk", "ChunkManager", "DeviceBudget", "DeviceBudgetError", "DiskStore", "GeminiOptimizer",
           "GeminiPlugin", "LRUPolicy", "ShardComm", "TensorState", "choose_chunk_size"]
