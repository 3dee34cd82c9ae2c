"""Concrete plugins. Each one is a strategy; swapping plugins never changes the training loop."""
from .single import SingleProcessPlugin

__all__ = ["SingleProcessPlugin"]
