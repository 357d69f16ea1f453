"""Arrow schemas of the Flight SQL metadata results, as the specification fixes them.

Clients (ADBC, JDBC) read these columns by position and type, so names, types and nullability
follow FlightSql.proto's comments to the letter.
"""
from __future__ import annotations

import pyarrow as pa

_utf8 = pa.utf8()

CATALOGS = pa.schema([pa.field("catalog_name", _utf8, nullable=False)])

DB_SCHEMAS = pa.schema([
    pa.field("catalog_name", _utf8),
    pa.field("db_schema_name", _utf8, nullable=False),
])

TABLES = pa.schema([
    pa.field("catalog_name", _utf8),
    pa.field("db_schema_name", _utf8),
    pa.field("table_name", _utf8, nullable=False),
    pa.field("table_type", _utf8, nullable=False),
])

TABLES_WITH_SCHEMA = TABLES.append(pa.field("table_schema", pa.binary(), nullable=False))

TABLE_TYPES = pa.schema([pa.field("table_type", _utf8, nullable=False)])

PRIMARY_KEYS = pa.schema([
    pa.field("catalog_name", _utf8),
    pa.field("db_schema_name", _utf8),
    pa.field("table_name", _utf8, nullable=False),
    pa.field("column_name", _utf8, nullable=False),
    pa.field("key_name", _utf8),
    pa.field("key_sequence", pa.int32(), nullable=False),
])

# Shared by CommandGetExportedKeys, CommandGetImportedKeys and CommandGetCrossReference.
FOREIGN_KEYS = pa.schema([
    pa.field("pk_catalog_name", _utf8),
    pa.field("pk_db_schema_name", _utf8),
    pa.field("pk_table_name", _utf8, nullable=False),
    pa.field("pk_column_name", _utf8, nullable=False),
    pa.field("fk_catalog_name", _utf8),
    pa.field("fk_db_schema_name", _utf8),
    pa.field("fk_table_name", _utf8, nullable=False),
    pa.field("fk_column_name", _utf8, nullable=False),
    pa.field("key_sequence", pa.int32(), nullable=False),
    pa.field("fk_key_name", _utf8),
    pa.field("pk_key_name", _utf8),
    pa.field("update_rule", pa.uint8(), nullable=False),
    pa.field("delete_rule", pa.uint8(), nullable=False),
])

# CommandGetSqlInfo: one row per info id; the value is a dense union whose type codes are the
# child positions below (0 string, 1 bool, 2 int64, 3 int32 bitmask, 4 string list, 5 map).
SQL_INFO_VALUE = pa.dense_union([
    pa.field("string_value", _utf8),
    pa.field("bool_value", pa.bool_()),
    pa.field("bigint_value", pa.int64()),
    pa.field("int32_bitmask", pa.int32()),
    pa.field("string_list", pa.list_(_utf8)),
    pa.field("int32_to_int32_list_map", pa.map_(pa.int32(), pa.list_(pa.int32()))),
])

SQL_INFO = pa.schema([
    pa.field("info_name", pa.uint32(), nullable=False),
    pa.field("value", SQL_INFO_VALUE),
])
