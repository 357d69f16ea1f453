"""Catalog metadata results: catalogs, database schemas, tables and table types.

expstore exposes one catalog with one schema holding the experience tables, so these are small
in-memory tables. Filters follow the specification: ``catalog`` is an exact match ("" selects
objects without a catalog, of which there are none), the ``*_filter_pattern`` fields are SQL LIKE
patterns with ``\\`` as escape (announced as SQL_SEARCH_STRING_ESCAPE).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import pyarrow as pa

from . import schemas

TABLE_TYPE = "TABLE"
TABLE_TYPES = (TABLE_TYPE,)


@lru_cache(maxsize=256)
def like_pattern(pattern: str) -> re.Pattern[str]:
    r"""Compile a SQL LIKE pattern: ``%`` any run, ``_`` one character, ``\`` escapes."""
    out: list[str] = []
    chars = iter(pattern)
    for ch in chars:
        if ch == "\\":
            out.append(re.escape(next(chars, "\\")))
        elif ch == "%":
            out.append(".*")
        elif ch == "_":
            out.append(".")
        else:
            out.append(re.escape(ch))
    return re.compile("".join(out), re.DOTALL)


def _matches(value: str, pattern: str | None) -> bool:
    return pattern is None or like_pattern(pattern).fullmatch(value) is not None


def catalogs_table(catalog: str) -> pa.Table:
    """CommandGetCatalogs: the one catalog."""
    return pa.Table.from_pylist([{"catalog_name": catalog}], schema=schemas.CATALOGS)


def db_schemas_table(catalog: str, db_schema: str, command: Any) -> pa.Table:
    """CommandGetDbSchemas, filtered by the command's catalog and schema pattern."""
    rows = []
    if _catalog_selected(catalog, command) and _matches(
            db_schema, _optional(command, "db_schema_filter_pattern")):
        rows.append({"catalog_name": catalog, "db_schema_name": db_schema})
    return pa.Table.from_pylist(rows, schema=schemas.DB_SCHEMAS)


def tables_table(catalog: str, db_schema: str, tables: Sequence[tuple[str, pa.Schema]],
                 command: Any) -> pa.Table:
    """CommandGetTables, filtered; with ``table_schema`` (IPC bytes) if ``include_schema``."""
    include_schema = bool(command.include_schema)
    schema = schemas.TABLES_WITH_SCHEMA if include_schema else schemas.TABLES
    types = list(command.table_types)
    selected = (_catalog_selected(catalog, command)
                and _matches(db_schema, _optional(command, "db_schema_filter_pattern"))
                and (not types or TABLE_TYPE in types))
    name_pattern = _optional(command, "table_name_filter_pattern")
    rows = []
    for name, table_schema in sorted(tables, key=lambda item: item[0]) if selected else []:
        if not _matches(name, name_pattern):
            continue
        row: dict[str, object] = {"catalog_name": catalog, "db_schema_name": db_schema,
                                  "table_name": name, "table_type": TABLE_TYPE}
        if include_schema:
            row["table_schema"] = table_schema.serialize().to_pybytes()
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema)


def table_types_table() -> pa.Table:
    """CommandGetTableTypes: experience tables are plain tables."""
    return pa.Table.from_pylist([{"table_type": t} for t in TABLE_TYPES],
                                schema=schemas.TABLE_TYPES)


def _optional(command: Any, field: str) -> str | None:
    return getattr(command, field) if command.HasField(field) else None


def _catalog_selected(catalog: str, command: Any) -> bool:
    wanted = _optional(command, "catalog")
    return wanted is None or wanted == catalog
