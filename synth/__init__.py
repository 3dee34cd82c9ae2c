"""The seeded synthetic-table prior and the size-bucketed stream that feeds pretraining."""
from synth.dataset import SynthDataset, SynthLoader
from synth.episodes import IMPUTATION, TASKS
from synth.stream import BatchInfo, Bucket, StreamConfig, SynthStream, bucket_at

__all__ = ["StreamConfig", "SynthStream", "SynthDataset", "SynthLoader", "Bucket", "BatchInfo", "bucket_at", "IMPUTATION", "TASKS"]
