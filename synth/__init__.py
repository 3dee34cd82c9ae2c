"""The seeded synthetic-table prior and the size-bucketed stream that feeds pretraining."""
from synth.config import PriorConfig
from synth.dataset import SynthDataset, SynthLoader
from synth.episodes import IMPUTATION, TASKS
from synth.prior import sample_table
from synth.raw import to_frame
from synth.stream import BatchInfo, Bucket, StreamConfig, SynthStream, bucket_at
from synth.table import CLASSIFICATION, REGRESSION, SynthTable

__all__ = [
    "PriorConfig", "sample_table", "to_frame", "SynthTable", "CLASSIFICATION", "REGRESSION",
   "StreamConfig", "SynthStream", "SynthDataset", "SynthLoader", "Bucket", "BatchInfo", "bucket_at", "IMPUTATION", "TASKS"]
