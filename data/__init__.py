"""Real tables and the one tensor contract: TableBatch, encoding, stores, loading."""
from data.batch import CATEGORICAL, NUMERIC, PAD, TableBatch

__all__ = ["TableBatch", "PAD", "NUMERIC", "CATEGORICAL"]
