"""Gemini: chunk-based heterogeneous memory (device budget, host, disk) for one process."""
from .chunks import Chunk, ChunkManager, TensorState, choose_chunk_size
from .plugin import GeminiOptimizer, GeminiPlugin
from .tiers import DeviceBudget, DeviceBudgetError, DiskStore

__all__ = ["Chunk", "ChunkManager", "DeviceBudget", "DeviceBudgetError", "DiskStore", "GeminiOptimizer",
           "GeminiPlugin", "TensorState", "choose_chunk_size"]
