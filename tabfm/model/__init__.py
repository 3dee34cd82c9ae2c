"""The tabfm table transformer: config, model, loss and prediction helpers."""
from .config import PRESETS, ModelConfig
from .heads import BarDistribution
from .loss import masked_cell_loss
from .transformer import ContextCache, ModelOutput, TabFM

__all__ = ["TabFM", "ModelConfig", "ModelOutput", "ContextCache", "masked_cell_loss", "BarDistribution", "PRESETS"]
