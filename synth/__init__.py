"""The seeded synthetic-table prior and the size-bucketed stream that feeds pretraining."""
from .config import PriorConfig
from .dataset import SynthDataset, SynthLoader
from .episodes import IMPUTATION, TASKS
from .prior import sample_table
from .raw import to_frame
from .stream import BatchInfo, Bucket, StreamConfig, SynthStream, bucket_at
from .table import CLASSIFICATION, REGRESSION, SynthTable

__all__ = [
    "PriorConfig", "sample_table", "to_frame", "SynthTable", "CLASSIFICATION", "REGRESSION",
   "StreamConfig", "SynthStream", "SynthDataset", "SynthLoader", "Bucket", "BatchInfo", "bucket_at", "IMPUTATION", "TASKS"]
