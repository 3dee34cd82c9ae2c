"""Real tables and the one tensor contract: TableBatch, encoding, stores, loading."""
from data.batch import CATEGORICAL, NUMERIC, PAD, TableBatch
from data.encode import EncodedTable, TableSchema, encode_frame
from data.schema import ColumnSpec, EncodeConfig, EncodedColumn

__all__ = [
    "TableBatch", "PAD", "NUMERIC", "CATEGORICAL",
    "encode_frame", "TableSchema", "EncodedTable", "EncodeConfig", "ColumnSpec", "EncodedColumn",
]
