"""Real tables and the one tensor contract: TableBatch, encoding, stores, loading."""
from tabfm.data.batch import CATEGORICAL, NUMERIC, PAD, TableBatch
from tabfm.data.encode import EncodedTable, TableSchema, encode_frame
from tabfm.data.readers import SourceTable, read_tables
from tabfm.data.schema import ColumnSpec, EncodeConfig, EncodedColumn
from tabfm.data.store import TableHeader, list_store, read_header, read_table, write_table

__all__ = [
    "TableBatch", "PAD", "NUMERIC", "CATEGORICAL",
    "encode_frame", "TableSchema", "EncodedTable", "EncodeConfig", "ColumnSpec", "EncodedColumn",
    "TableHeader", "write_table", "list_store", "read_header", "read_table",
    "read_tables", "SourceTable",
]
