"""The read-only guard of the query path.

Two layers, so that one mistake is not enough:

1. the database is opened with external access disabled, extension auto-loading off and its
   configuration locked (see :mod:`store.embedded`), so no query can read files, attach databases,
   load extensions or change settings whatever this module lets through;
2. here, each query is parsed by DuckDB itself: exactly one statement, of type SELECT, whose syntax
   tree calls no function that reads files, runs SQL from strings or touches the environment,
   and reads none of the system views that show the server (its settings, the database's
   absolute path, secret and extension directories, its log).
"""
from __future__ import annotations

import atexit
import json
import threading
from typing import Any, Iterator

import duckdb

from .errors import QueryRefused

# Table functions a read-only query may use; everything else (read_csv, glob, query_table,
# pragma_*, …) is refused.
ALLOWED_TABLE_FUNCTIONS = frozenset({
    "unnest", "range", "generate_series", "duckdb_tables", "duckdb_columns", "duckdb_views",
    "duckdb_schemas", "duckdb_types", "duckdb_constraints", "duckdb_indexes",
})
# Scalar functions refused by name or prefix: file, environment and SQL-from-string access.
DENIED_FUNCTION_PREFIXES = (
    "read_", "glob", "getenv", "pragma", "query", "sniff", "parquet_", "json_execute",
    "checkpoint", "force_checkpoint", "setseed", "install", "load", "export_", "import_",
    "current_setting", "duckdb_secrets", "duckdb_settings", "duckdb_extensions", "iceberg",
    "delta_", "sqlite_", "postgres_", "mysql_", "http", "s3", "getvariable", "write_log",
    "sleep_ms", "pg_sleep", "nextval", "setval", "currval", "which_secret", "user_agent",
)
# DuckDB's built-in views over those functions: readers of the store have no business with the
# server's settings (``pg_settings``), the database file's absolute path (``duckdb_databases``,
# ``pragma_database_list``) or its log. Matched by name whatever the schema (``system.main.x``);
# user tables cannot have these names (``duckdb_`` and ``pg_`` are reserved prefixes).
DENIED_VIEWS = frozenset({"duckdb_databases", "pragma_database_list", "duckdb_logs",
                          "pg_settings", "pg_prepared_statements"})
MAX_SQL_CHARS = 100_000
# Characters of file paths, URLs, extensions and globs; no store or catalog table name has them.
_PATH_CHARS = "/\\.:*?~"

# A private in-memory database only parses; it never sees the store's data. It is opened on the
# first check, not at import: a remote client imports this module and never parses SQL.
_parser: duckdb.DuckDBPyConnection | None = None
_parser_lock = threading.Lock()


def _parse_tree(sql: str) -> Any:
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect(":memory:")
            atexit.register(_parser.close)
        return _parser.execute("SELECT json_serialize_sql(?::VARCHAR)", [sql]).fetchone()


def check_select(sql: object) -> str:
    """Return ``sql`` if it is one read-only SELECT; raise :class:`QueryRefused` otherwise."""
    if not isinstance(sql, str) or not sql.strip():
        raise QueryRefused(f"query {sql!r} is not a non-empty SQL string")
    if len(sql) > MAX_SQL_CHARS:
        raise QueryRefused(f"query of {len(sql)} characters is longer than the "
                           f"{MAX_SQL_CHARS}-character limit")
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryRefused(f"query does not parse: {e}") from e
    if len(statements) != 1:
        raise QueryRefused(f"query holds {len(statements)} statements; expected exactly one "
                           "SELECT")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryRefused(f"{kind.name} statements are refused: the query path is read-only "
                           "and takes one SELECT")
    for name, where in _functions(sql):
        if where == "statement":
            raise QueryRefused(f"a data-modifying {name.removesuffix('_QUERY_NODE')} inside the "
                               "query (e.g. in a WITH clause) is refused: the query path is "
                               "read-only")
        if where == "file":
            raise QueryRefused(f"table {name!r} looks like a file path or URL; the query path "
                               "reads only the store's tables")
        lowered = name.lower()
        if where == "view":
            if lowered in DENIED_VIEWS:
                raise QueryRefused(f"system view {name!r} is refused on the query path: it shows "
                                   "the server's settings, files or log")
            continue
        if where == "table" and lowered not in ALLOWED_TABLE_FUNCTIONS:
            raise QueryRefused(f"table function {name!r} is refused on the query path; allowed: "
                               f"{', '.join(sorted(ALLOWED_TABLE_FUNCTIONS))}")
        if lowered.startswith(DENIED_FUNCTION_PREFIXES):
            raise QueryRefused(f"function {name!r} is refused on the query path (file, "
                               "environment or SQL-from-string access)")
    return sql


def check_predicate(where: object) -> str:
    """Validate a claim predicate (a boolean SQL expression over one table's columns)."""
    if not isinstance(where, str) or not where.strip():
        raise QueryRefused(f"predicate {where!r} is not a non-empty SQL expression")
    if ";" in where:
        raise QueryRefused(f"predicate {where[:80]!r} holds ';'; expected one boolean expression")
    check_select(f"SELECT 1 FROM (SELECT 1) AS _t WHERE ({where})")
    return where


def _functions(sql: str) -> Iterator[tuple[str, str]]:
    """Every function call and base table in the statement's syntax tree, as (name, kind):
    kind is 'scalar', 'table' (a table function), 'view' (a base table or view), 'file' (a
    replacement scan of a path) or 'statement' (a data-modifying node)."""
    raw = _parse_tree(sql)
    tree = json.loads(raw[0]) if raw else {}
    if tree.get("error"):
        raise QueryRefused(f"query does not parse: {tree.get('error_message', 'unknown error')}")
    yield from _walk(tree)


def _walk(node: Any) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        # ``FROM '/etc/passwd'`` or ``FROM 'x.parquet'`` is a file read (a replacement scan),
        # not a table: the syntax tree shows it as a base table named like a path.
        if node.get("type") == "BASE_TABLE" and any(
                ch in str(node.get("table_name", "")) for ch in _PATH_CHARS):
            yield str(node["table_name"]), "file"
        elif node.get("type") == "BASE_TABLE" and "table_name" in node:
            yield str(node["table_name"]), "view"
        kind = node.get("type")
        if isinstance(kind, str) and kind.endswith("_QUERY_NODE"):
            yield kind, "statement"  # DELETE/UPDATE/INSERT… nodes, e.g. a data-modifying CTE
        if node.get("type") == "TABLE_FUNCTION":
            fn = node.get("function") or {}
            if isinstance(fn, dict) and "function_name" in fn:
                yield fn["function_name"], "table"
        if node.get("class") == "FUNCTION" and "function_name" in node:
            yield node["function_name"], "scalar"
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)
