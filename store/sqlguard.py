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
import functools
import json
import math
import threading
from typing import Any, Iterator

import duckdb

from .errors import InvalidArgument, QueryRefused
from .naming import quote

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
# The store's own functions (the by-reference value resolvers of store/sqlvalues.py): only the
# store's views call them, on keys it wrote.
INTERNAL_FUNCTION_PREFIX = "expstore_"
MAX_SQL_CHARS = 100_000
# Characters of file paths, URLs, extensions and globs; no store or catalog table name has them.
_PATH_CHARS = "/\\.:*?~"

# A private in-memory database only parses; it never sees the store's data. It is opened on the
# first check, not at import: a remote client imports this module and never parses SQL.
_parser: duckdb.DuckDBPyConnection | None = None
_parser_lock = threading.Lock()


# The guard and sqlvalues.whole_table both parse a query; a caller repeating a query (a
# trainer's or an exporter's loop) parses it once.
@functools.lru_cache(maxsize=64)
def _parse_tree(sql: str) -> Any:
    global _parser
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect(":memory:")
            atexit.register(_parser.close)
        return _parser.execute("SELECT json_serialize_sql(?::VARCHAR)", [sql]).fetchone()


def parse_tree(sql: str) -> Any:
    """DuckDB's parse tree of ``sql`` (``json_serialize_sql``, decoded), parsed by the private
    in-memory database."""
    return json.loads(_parse_tree(sql)[0])


def check_sql_text(sql: object) -> str:
    """Return ``sql`` if it is a non-empty string within the length limit (what a client checks
    before sending; the server checks the rest)."""
    if not isinstance(sql, str) or not sql.strip():
        raise QueryRefused(f"query {sql!r} is not a non-empty SQL string")
    if len(sql) > MAX_SQL_CHARS:
        raise QueryRefused(f"query of {len(sql)} characters is longer than the "
                           f"{MAX_SQL_CHARS}-character limit")
    return sql


def check_query_options(params: object, timeout: object) -> None:
    """Refuse query parameters that are not a list, and a time limit that is not a positive
    number of seconds (what a client checks before sending, as the embedded store does).

    Raises:
        InvalidArgument: naming the value.
    """
    if params is not None and not isinstance(params, (list, tuple)):
        raise InvalidArgument(f"query parameters {params!r} are not a list; expected a list of "
                              "values, one for each ?")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise InvalidArgument(f"query timeout {timeout!r} is invalid; expected a number of "
                              "seconds > 0")


def check_select(sql: object) -> str:
    """Return ``sql`` if it is one read-only SELECT; raise :class:`QueryRefused` otherwise.

    The verdict depends on the text alone, so a text that passed is remembered (as its parse
    tree is): a caller repeating a query (a trainer's or an exporter's loop) is checked once.
    A refused text is checked again each time."""
    sql = check_sql_text(sql)
    _checked_select(sql)
    return sql


@functools.lru_cache(maxsize=256)
def _checked_select(sql: str) -> None:
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise QueryRefused(f"query does not parse: {e}") from e
    if len(statements) != 1:
        raise QueryRefused(f"query holds {len(statements)} statements; expected exactly one "
                           "SELECT")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise QueryRefused(f"{statements[0].query.strip()[:80]!r} ({kind.name} statement) is "
                           "refused: the query path is read-only and takes one SELECT")
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
        if lowered.startswith(INTERNAL_FUNCTION_PREFIX):
            raise QueryRefused(f"function {name!r} is internal to the store; select the column "
                               "itself, whose by-reference values read as values")
        if lowered.startswith(DENIED_FUNCTION_PREFIXES):
            raise QueryRefused(f"function {name!r} is refused on the query path (file, "
                               "environment or SQL-from-string access)")


def check_predicate(where: object) -> str:
    """Validate a claim predicate (a boolean SQL expression over one table's columns)."""
    predicate_query("t", where)
    assert isinstance(where, str)  # predicate_query refuses anything else
    return where


#: Where a claim's predicate goes in the query it runs; ``?`` is the list of candidate row ids.
_PREDICATE_QUERY = ("SELECT row_id FROM (SELECT row_id, ({slot}) AS _expstore_ok FROM {table} "
                    "WHERE row_id IN (SELECT unnest(?::BIGINT[]))) AS _expstore_rows "
                    "WHERE _expstore_ok")
_SLOT = "_expstore_predicate_slot"
_LOCATION_KEYS = frozenset({"query_location", "query_location_length"})


def predicate_query(table: str, where: object) -> str:
    """The query a claim runs to learn which of its candidate rows (the one ``?``: a list of row
    ids) satisfy ``where``, checked as it will run.

    The predicate is spliced into SQL text, so the guard checks that text, not the predicate
    alone: the query must be one read-only SELECT (:func:`check_select`), and its syntax tree
    must be the template's with exactly one expression, the predicate parsed on its own, in the
    predicate's place. Text that changes the query around the predicate is refused (``reward >
    0) LIMIT (1``, a second column, a ``FROM``, a ``?``); ``reward > 0) OR (1=1`` stands as the
    one expression ``(reward > 0) OR (1=1)``, which is what it means on its own. (The predicate
    sits in a select list, not beside ``AND`` in a WHERE clause, because DuckDB flattens nested
    ``AND``s: there, ``a) AND (b`` and ``a AND b`` give the same tree.)

    Raises:
        QueryRefused: naming the predicate and what was expected.
    """
    if not isinstance(where, str) or not where.strip():
        raise QueryRefused(f"predicate {where!r} is not a non-empty SQL expression")
    if len(where) > MAX_SQL_CHARS:
        raise QueryRefused(f"predicate of {len(where)} characters is longer than the "
                           f"{MAX_SQL_CHARS}-character limit")
    return _checked_predicate_query(table, where)


@functools.lru_cache(maxsize=256)
def _checked_predicate_query(table: str, where: str) -> str:
    # Newlines around the predicate: a trailing ``--`` comment then ends before the parenthesis.
    sql = _PREDICATE_QUERY.format(slot=f"\n{where}\n", table=quote(table))
    alone = _tree(f"SELECT (\n{where}\n)", where)
    node = alone.get("statements", [{}])[0].get("node", {})
    items = node.get("select_list") or []
    if (len(alone.get("statements", [])) != 1 or len(items) != 1
            or (node.get("from_table") or {}).get("type") != "EMPTY"
            or any(node.get(k) for k in ("where_clause", "group_expressions", "having",
                                          "modifiers", "qualify", "sample"))):
        raise QueryRefused(f"predicate {where[:200]!r} is not one boolean SQL expression "
                           "(e.g. \"reward > 0\")")
    try:
        check_select(sql)
    except QueryRefused as e:
        raise QueryRefused(f"predicate {where[:200]!r} is refused: {e}") from e
    template = _tree(_PREDICATE_QUERY.format(slot=_SLOT, table=quote(table)), where)
    if not _fits(template, _tree(sql, where), _plain(items[0])):
        raise QueryRefused(f"predicate {where[:200]!r} is not one expression in the claim's "
                           "query: it changes the query around it (e.g. an unbalanced "
                           "parenthesis, or a '?' parameter); expected one boolean SQL "
                           "expression such as \"reward > 0\"")
    return sql


def _tree(sql: str, where: str) -> dict[str, Any]:
    raw = _parse_tree(sql)
    tree = json.loads(raw[0]) if raw else {}
    if tree.get("error"):
        raise QueryRefused(f"predicate {where[:200]!r} does not parse: "
                           f"{tree.get('error_message', 'unknown error')}")
    return tree


def _plain(node: Any) -> Any:
    """A syntax tree without source positions."""
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items() if k not in _LOCATION_KEYS}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def _fits(template: Any, tree: Any, expression: Any) -> bool:
    """Whether ``tree`` is ``template`` with ``expression`` where the template has the slot."""
    if isinstance(template, dict):
        if template.get("class") == "COLUMN_REF" and template.get("column_names") == [_SLOT]:
            return isinstance(tree, dict) and _plain({**tree, "alias": ""}) == \
                {**expression, "alias": ""}
        return (isinstance(tree, dict) and template.keys() == tree.keys()
                and all(k in _LOCATION_KEYS or _fits(v, tree[k], expression)
                        for k, v in template.items()))
    if isinstance(template, list):
        return (isinstance(tree, list) and len(template) == len(tree)
                and all(_fits(a, b, expression) for a, b in zip(template, tree)))
    return template == tree


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
