"""The CommandGetSqlInfo answer: what this server tells clients about itself.

Ids and enum values are the specification's (``SqlInfo`` and friends in FlightSql.proto). The
set covers what ADBC reads (vendor name/version/Arrow version, SQL and Substrait support,
transactions, cancellation) plus the facts a read-only DuckDB-backed server should state:
read-only, no DDL, no transactions, identifier quoting and case, null ordering.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pyarrow as pa

from . import schemas

# SqlInfo ids (FlightSql.proto, enum SqlInfo).
FLIGHT_SQL_SERVER_NAME = 0
FLIGHT_SQL_SERVER_VERSION = 1
FLIGHT_SQL_SERVER_ARROW_VERSION = 2
FLIGHT_SQL_SERVER_READ_ONLY = 3
FLIGHT_SQL_SERVER_SQL = 4
FLIGHT_SQL_SERVER_SUBSTRAIT = 5
FLIGHT_SQL_SERVER_TRANSACTION = 8
FLIGHT_SQL_SERVER_CANCEL = 9
FLIGHT_SQL_SERVER_STATEMENT_TIMEOUT = 100
FLIGHT_SQL_SERVER_TRANSACTION_TIMEOUT = 101
SQL_DDL_CATALOG = 500
SQL_DDL_SCHEMA = 501
SQL_DDL_TABLE = 502
SQL_IDENTIFIER_CASE = 503
SQL_IDENTIFIER_QUOTE_CHAR = 504
SQL_QUOTED_IDENTIFIER_CASE = 505
SQL_ALL_TABLES_ARE_SELECTABLE = 506
SQL_NULL_ORDERING = 507
SQL_SEARCH_STRING_ESCAPE = 513
SQL_SUPPORTS_COLUMN_ALIASING = 515
SQL_SCHEMA_TERM = 529
SQL_CATALOG_TERM = 531
SQL_TRANSACTIONS_SUPPORTED = 563
SQL_BATCH_UPDATES_SUPPORTED = 572
SQL_SAVEPOINTS_SUPPORTED = 573

# Enum values used below.
SQL_SUPPORTED_TRANSACTION_NONE = 0
SQL_CASE_SENSITIVITY_CASE_INSENSITIVE = 1
SQL_NULLS_SORTED_AT_END = 3  # DuckDB's default: NULLS LAST for ASC and DESC

# Union type codes, i.e. the child positions of schemas.SQL_INFO_VALUE.
_STRING, _BOOL, _BIGINT, _INT32 = 0, 1, 2, 3


@dataclass(frozen=True)
class Int32:
    """An int32 answer (an enum ordinal or a bitmask), as opposed to a plain int64 one."""

    value: int


SqlInfoValue = str | bool | int | Int32


def default_sql_info(server_name: str, server_version: str,
                     statement_timeout_ms: int) -> dict[int, SqlInfoValue]:
    """The SqlInfo of expstore's read-only Flight SQL endpoint."""
    return {
        FLIGHT_SQL_SERVER_NAME: server_name,
        FLIGHT_SQL_SERVER_VERSION: server_version,
        FLIGHT_SQL_SERVER_ARROW_VERSION: pa.__version__,
        FLIGHT_SQL_SERVER_READ_ONLY: True,
        FLIGHT_SQL_SERVER_SQL: True,
        FLIGHT_SQL_SERVER_SUBSTRAIT: False,
        FLIGHT_SQL_SERVER_TRANSACTION: Int32(SQL_SUPPORTED_TRANSACTION_NONE),
        FLIGHT_SQL_SERVER_CANCEL: False,
        FLIGHT_SQL_SERVER_STATEMENT_TIMEOUT: Int32(statement_timeout_ms),
        FLIGHT_SQL_SERVER_TRANSACTION_TIMEOUT: Int32(0),
        SQL_DDL_CATALOG: False,
        SQL_DDL_SCHEMA: False,
        SQL_DDL_TABLE: False,
        SQL_IDENTIFIER_CASE: Int32(SQL_CASE_SENSITIVITY_CASE_INSENSITIVE),
        SQL_IDENTIFIER_QUOTE_CHAR: '"',
        SQL_QUOTED_IDENTIFIER_CASE: Int32(SQL_CASE_SENSITIVITY_CASE_INSENSITIVE),
        SQL_ALL_TABLES_ARE_SELECTABLE: True,
        SQL_NULL_ORDERING: Int32(SQL_NULLS_SORTED_AT_END),
        SQL_SEARCH_STRING_ESCAPE: "\\",
        SQL_SUPPORTS_COLUMN_ALIASING: True,
        SQL_SCHEMA_TERM: "schema",
        SQL_CATALOG_TERM: "catalog",
        SQL_TRANSACTIONS_SUPPORTED: False,
        SQL_BATCH_UPDATES_SUPPORTED: False,
        SQL_SAVEPOINTS_SUPPORTED: False,
    }


def sql_info_table(values: Mapping[int, SqlInfoValue], requested: Iterable[int]) -> pa.Table:
    """The GetSqlInfo result for ``requested`` ids (all known ids when empty).

    Unknown ids are left out rather than refused: clients such as ADBC ask for ids from newer
    protocol versions and treat a missing row as "not stated".
    """
    wanted = list(dict.fromkeys(requested))
    ids = [i for i in wanted if i in values] if wanted else sorted(values)
    fields = list(schemas.SQL_INFO_VALUE)
    children: list[list[object]] = [[] for _ in fields]
    type_codes: list[int] = []
    offsets: list[int] = []
    for info_id in ids:
        code, item = _encode(values[info_id])
        type_codes.append(code)
        offsets.append(len(children[code]))
        children[code].append(item)
    arrays = [pa.array(items, type=field.type) for items, field in zip(children, fields)]
    union = pa.UnionArray.from_dense(
        pa.array(type_codes, pa.int8()), pa.array(offsets, pa.int32()), arrays,
        [field.name for field in fields], list(range(len(fields))))
    return pa.Table.from_arrays([pa.array(ids, pa.uint32()), union], schema=schemas.SQL_INFO)


def _encode(value: SqlInfoValue) -> tuple[int, object]:
    if isinstance(value, Int32):
        return _INT32, value.value
    if isinstance(value, bool):  # before int: bool is an int subclass
        return _BOOL, value
    if isinstance(value, int):
        return _BIGINT, value
    return _STRING, value
