"""SQL sees every value: a by-reference column reads as its value on the query path.

A column stored by reference keeps NULL in DuckDB where its value went to the blob store, and
the key beside it (``X__ref``; see :mod:`store.schema`). On each query cursor, every table with
such columns is shadowed by a temporary view of the same name (DuckDB looks temporary objects
up first), which is the table with each such column replaced::

    CASE WHEN X__ref IS NULL THEN X ELSE <resolver>(X__ref) END AS X

The resolver is a vectorised (Arrow) scalar function over :meth:`BlobStore.resolve`. Why views
rather than resolving the result afterwards: every part of a query sees the values (functions
over the column, ``WHERE … LIKE``, ``GROUP BY``, joins, claim predicates), and DuckDB inlines
the view, so a query that does not use ``X`` never calls the resolver (projection pruning),
filters on other columns run before it, ``CASE`` calls it only for rows that have a key, and
``ORDER BY … LIMIT`` resolves only the rows it keeps (DuckDB's late materialisation).

Safety: the resolver's names start with :data:`store.sqlguard.INTERNAL_FUNCTION_PREFIX`, which
the guard refuses in users' SQL, so only the views call it, on keys the store wrote; it also
accepts nothing but well-formed keys (``segment:offset:length:row``), which name chunks inside
the store's own segment files and are checked against their checksums when read.

One shape of query skips the views: a whole table's ``SELECT *`` (:func:`whole_table`) is run on
the stored table and its values put in afterwards (:func:`with_values`), the same result
without every value passing through DuckDB twice.

Each query cursor has resolvers of its own (DuckDB's functions are global to the database, so
they are named per cursor): a cursor runs one query at a time, so a blob error recorded by its
resolver belongs to that query and can be raised to the caller as the :class:`StorageError` it
was, instead of the text DuckDB wraps it in.
"""
from __future__ import annotations

import functools
import itertools
import re
import threading
import uuid
from typing import Callable, Iterable

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from duckdb.func import PythonUDFType

from .blobs import BlobStore
from .errors import StorageError
from .naming import quote
from .schema import TableDef
from .sqlguard import INTERNAL_FUNCTION_PREFIX, parse_tree
from .halves import has_half, widened, widened_from_stored, widened_type
from .types import duckdb_type, type_name

# A blob key: segment, offset, length, row (see store/blobs.py).
KEY = re.compile(r"[0-9]{1,12}:[0-9]{1,15}:[0-9]{1,15}:[0-9]{1,12}")


class ValueCursor:
    """A query cursor whose tables show by-reference values (one per reading thread)."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection, database: str) -> None:
        self.cursor = cursor
        self.database = database
        self.seen_ddl = -1                      # the catalog change its views were made for
        self.views: dict[str, str] = {}         # table -> the view's SELECT
        self.resolvers: dict[str, str] = {}     # its kind (see ValueViews._function) -> name
        self.errors: list[StorageError] = []    # blob errors of the query running on it
        # table -> the relation reading it whole as stored (see stored_relation)
        self.relations: dict[str, duckdb.DuckDBPyRelation] = {}

    def stored_relation(self, table: str) -> duckdb.DuckDBPyRelation:
        """The relation reading ``table`` whole as stored (keys, no values), kept until the
        catalog changes (:meth:`ValueViews.refresh`). Why: binding ``SELECT *`` of a wide table
        cost about a third of reading its rows; a relation reads the table as it is each time
        it runs."""
        relation = self.relations.get(table)
        if relation is None:
            relation = self.cursor.sql(f"SELECT * FROM {quote(self.database)}.main."
                                       f"{quote(table)}")
            self.relations[table] = relation
        return relation

    def take_error(self) -> StorageError | None:
        """The first blob error of the last query (and forget them all)."""
        first = self.errors[0] if self.errors else None
        self.errors.clear()                 # in place: the resolvers hold this list
        return first


class ValueViews:
    """Makes and refreshes the resolving views of query cursors for one store."""

    def __init__(self, blobs: BlobStore) -> None:
        self._blobs = blobs
        # Function names are global to the database and a process may open several stores.
        self._token = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._lock = threading.Lock()

    def cursor(self, cursor: duckdb.DuckDBPyConnection) -> ValueCursor:
        [(database,)] = cursor.execute("SELECT current_database()").fetchall()
        return ValueCursor(cursor, str(database))

    def refresh(self, vc: ValueCursor, tables: Iterable[TableDef], ddl_seq: int) -> None:
        """Bring ``vc``'s views in line with ``tables`` (the catalog as of change ``ddl_seq``)."""
        if vc.seen_ddl == ddl_seq:
            return
        vc.relations.clear()
        wanted = {t.name: self._view_sql(vc, t) for t in tables
                  if any(c.ref or has_half(c.type) for c in t.columns)}
        for name in [n for n in vc.views if n not in wanted]:
            vc.cursor.execute(f"DROP VIEW IF EXISTS temp.main.{quote(name)}")
            del vc.views[name]
        for name, select in wanted.items():
            if vc.views.get(name) != select:
                vc.cursor.execute(f"CREATE OR REPLACE TEMP VIEW {quote(name)} AS {select}")
                vc.views[name] = select
        vc.seen_ddl = ddl_seq

    def _view_sql(self, vc: ValueCursor, tdef: TableDef) -> str:
        replaced = []
        for c in tdef.columns:
            # half-precision values: their 16-bit patterns in the table, FLOAT in SQL
            inline = f"{self._widener(vc, c.type)}({quote(c.name)})" if has_half(c.type) \
                else quote(c.name)
            if c.ref:
                fn = self._resolver(vc, c.type)
                replaced.append(f"CASE WHEN {quote(c.ref)} IS NULL THEN {inline} "
                                f"ELSE {fn}({quote(c.ref)}) END AS {quote(c.name)}")
            elif has_half(c.type):
                replaced.append(f"{inline} AS {quote(c.name)}")
        # ``* REPLACE`` keeps the table's own columns and order (keys included, so that SQL can
        # still tell where a value is stored).
        return (f"SELECT * REPLACE ({', '.join(replaced)}) "
                f"FROM {quote(vc.database)}.main.{quote(tdef.name)}")

    def _widener(self, vc: ValueCursor, value_type: pa.DataType) -> str:
        """The name of ``vc``'s function turning stored half-precision patterns of
        ``value_type`` into FLOAT values (:func:`store.halves.widened_from_stored`)."""

        def widen(values: pa.Array) -> pa.Array:
            return widened_from_stored(values, value_type)

        return self._function(vc, f"widen {type_name(value_type)}", widen,
                              duckdb_type(value_type), duckdb_type(widened_type(value_type)))

    def _resolver(self, vc: ValueCursor, value_type: pa.DataType) -> str:
        """The name of ``vc``'s resolver for values of ``value_type``, registered on first use."""
        blobs, errors = self._blobs, vc.errors

        def resolve(keys: pa.Array) -> pa.Array:
            try:
                return widened(_resolve(blobs, keys, value_type))
            except StorageError as e:
                errors.append(e)
                raise

        # by value type: float16 and bfloat16 values are both FLOAT in SQL, read apart
        return self._function(vc, type_name(value_type), resolve, "VARCHAR",
                              duckdb_type(widened_type(value_type)))

    def _function(self, vc: ValueCursor, kind: str, fn: Callable[[pa.Array], pa.Array],
                  param: str, returns: str) -> str:
        """The name of ``vc``'s function ``kind`` (``fn`` of one ``param``), registered on
        first use."""
        name = vc.resolvers.get(kind)
        if name is None:
            with self._lock:
                name = f"{INTERNAL_FUNCTION_PREFIX}value_{self._token}_{next(self._serial)}"
            vc.cursor.create_function(name, fn, [param], returns, type=PythonUDFType.ARROW)
            vc.resolvers[kind] = name
        return name


#: Vectors of at least this many keys first try the bulk path (below it a kernel's fixed cost
#: is more than the Python check).
BULK_KEYS = 64


def _resolve(blobs: BlobStore, keys: pa.Array | pa.ChunkedArray,
             value_type: pa.DataType) -> pa.Array:
    """The values of well-formed blob keys (nulls stay null); any other string is an error."""
    # A vector of one put's rows in order (SELECT * of a column) is checked and cut in bulk
    # (BlobStore.resolve_keys); other keys are checked in Python: the values come a DuckDB
    # vector at a time (often a few rows, after a filter), where a compute kernel's fixed cost
    # was most of the call.
    if len(keys) >= BULK_KEYS:
        values = blobs.resolve_keys(keys, value_type)
        if values is not None:
            return values
    listed = keys.to_pylist()
    for key in listed:
        if key is not None and not KEY.fullmatch(key):
            raise StorageError(f"blob key {key!r} is not a key of this store; expected "
                               "'segment:offset:length:row' (four whole numbers)")
    return blobs.resolve(listed, value_type)


# What a whole table's ``SELECT *`` holds beside its one star and one table: nothing.
_BARE_SELECT: dict[str, object] = {
    "modifiers": [], "where_clause": None, "group_expressions": [], "group_sets": [],
    "having": None, "sample": None, "qualify": None}
_BARE_STAR: dict[str, object] = {
    "relation_name": "", "exclude_list": [], "replace_list": [], "columns": False, "expr": None,
    "qualified_exclude_list": [], "rename_list": []}


@functools.lru_cache(maxsize=256)
def whole_table(sql: str) -> str | None:
    """The table ``sql`` reads whole, when it is exactly ``SELECT * FROM <table>`` (no filter,
    order, limit, other column or clause), else None.

    Why: such a query returns each by-reference value as stored, so the store can run it on
    the stored table (keys in place of values) and cut the values afterwards, by row number
    from the chunks they are in (:meth:`BlobStore.resolve_keys`), instead of DuckDB taking each
    value in through the resolver and handing it out again: most of such a query's time, and
    a copy of every value twice. (A function of the text alone: remembered per text, as
    the guard's verdict is.)"""
    try:
        tree = parse_tree(sql)
        (statement,) = tree["statements"]
        node = statement["node"]
        (star,) = node["select_list"]
        source = node["from_table"]
    except (ValueError, KeyError, TypeError, duckdb.Error):
        return None
    if node.get("type") != "SELECT_NODE" or node.get("cte_map", {}).get("map") != [] \
            or any(node.get(k, "absent") != v for k, v in _BARE_SELECT.items()) \
            or star.get("class") != "STAR" \
            or any(star.get(k, "absent") != v for k, v in _BARE_STAR.items()) \
            or source.get("type") != "BASE_TABLE" or source.get("sample") is not None \
            or source.get("at_clause") is not None or source.get("catalog_name") != "" \
            or source.get("schema_name") not in ("", "main") \
            or source.get("column_name_alias") != [] or source.get("alias") != "":
        return None
    name = source.get("table_name")
    return name if isinstance(name, str) else None


def with_values(blobs: BlobStore, table: pa.Table, tdef: TableDef) -> pa.Table:
    """``table`` (rows of ``tdef``'s stored table, keys included) with each by-reference
    column's values in place: cut in bulk where the keys are a run of one chunk's rows, else
    resolved key by key; and half-precision values as FLOAT; as the resolving views give them
    (same values)."""
    names = set(table.schema.names)   # (a table's column_names builds a new list each time)
    for c in tdef.columns:
        half = has_half(c.type)  # stored as 16-bit patterns, seen as FLOAT (store/halves.py)
        keys = table.column(c.ref) if c.ref and c.ref in names else None
        by_value = keys is None or keys.null_count == len(keys)
        if c.name not in names or (by_value and not half):
            continue
        at = table.schema.get_field_index(c.name)
        inline = table.column(at)
        if half:
            inline = widened_from_stored(inline, c.type)
        if keys is None or by_value:
            values = inline
        else:
            target = c.type if half else table.schema.field(at).type
            values = blobs.resolve_keys(keys, target) if keys.null_count == 0 else None
            if values is None:
                values = blobs.resolve(keys.to_pylist(), target)
            values = widened(values)
            if keys.null_count:
                values = pc.if_else(pc.is_valid(keys), values, inline)
        table = table.set_column(at, table.schema.field(at).with_type(values.type), values)
    return table


def drop_keys(table: pa.Table) -> pa.Table:
    """A result without the ``X__ref`` keys of columns ``X`` it also holds (as ``SELECT *``
    gives them): ``X`` already carries the value, and the key is storage detail."""
    listed = table.schema.names
    names = set(listed)
    keys = [n for n in listed if n.endswith("__ref") and n[: -len("__ref")] in names]
    return table.drop_columns(keys) if keys else table
