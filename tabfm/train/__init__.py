"""Training recipes: optimizers and schedules, the step loop, pretraining on the synthetic stream."""
from tabfm.train.config import PretrainConfig
from tabfm.train.optim import build_optimizer, warmup_cosine
from tabfm.train.trainer import Trainer, TrainResult

__all__ = ["PretrainConfig", "Trainer", "TrainResult", "build_optimizer", "warmup_cosine"]
