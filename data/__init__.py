"""Real tables and the one tensor contract: TableBatch, encoding, stores, loading."""
from .batch import CATEGORICAL, NUMERIC, PAD, TableBatch
from .encode import EncodedTable, TableSchema, encode_frame
from .readers import SourceTable, read_tables
from .schema import ColumnSpec, EncodeConfig, EncodedColumn
from .store import TableHeader, list_store, read_header, read_table, write_table

__all__ = [
    "TableBatch", "PAD", "NUMERIC", "CATEGORICAL",
    "encode_frame", "TableSchema", "EncodedTable", "EncodeConfig", "ColumnSpec", "EncodedColumn",
    "TableHeader", "write_table", "list_store", "read_header", "read_table",
    "read_tables", "SourceTable",
]
