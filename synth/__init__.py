"""The seeded synthetic-table prior and the size-bucketed stream that feeds pretraining."""
from tabfm.synth.config import PriorConfig
from tabfm.synth.dataset import SynthDataset, SynthLoader
from tabfm.synth.episodes import IMPUTATION, TASKS
from tabfm.synth.prior import sample_table
from tabfm.synth.raw import to_frame
from tabfm.synth.stream import BatchInfo, Bucket, StreamConfig, SynthStream, bucket_at
from tabfm.synth.table import CLASSIFICATION, REGRESSION, SynthTable

__all__ = [
    "PriorConfig", "sample_table", "to_frame", "SynthTable", "CLASSIFICATION", "REGRESSION",
   "StreamConfig", "SynthStream", "SynthDataset", "SynthLoader", "Bucket", "BatchInfo", "bucket_at", "IMPUTATION", "TASKS"]
