"""Creating and dropping tables: the catalog rows and DDL the writer runs, and the index change
made once they commit.

Each function returns a :class:`~store.ops.CallOp` for the writer: its ``run`` checks the
request against the index on the writer thread (so two creates of one name cannot both pass)
and writes the table, its catalog row and its version group; its ``apply`` changes the index
only after the commit.
"""
from __future__ import annotations

import duckdb

from .barrier import SETTING_PREFIX
from .errors import AlreadyExists
from .index import StoreIndex
from .naming import quote
from .ops import CallOp
from .schema import TableDef


def create_table_op(index: StoreIndex, tdef: TableDef, if_not_exists: bool) -> CallOp:
    """Create the table ``tdef`` describes; the op's answer: whether it was created (false: it
    existed and ``if_not_exists`` accepted it).

    Raises (from the op):
        AlreadyExists: the table exists and ``if_not_exists`` is false, or one whose name
            differs only in case exists.
    """
    name = tdef.name

    def run(con: duckdb.DuckDBPyConnection) -> bool:
        # SQL folds identifiers' case, quoted or not: "EXP" beside "exp" is one table to it.
        clash = next((t for t in index.live if t.lower() == name.lower() and t != name), None)
        if clash is not None:
            raise AlreadyExists(f"table {name!r} clashes with the existing table {clash!r}: "
                                "table names that differ only in case are one name in SQL; "
                                "choose another name")
        if name in index.live:
            if if_not_exists:
                return False
            raise AlreadyExists(f"table {name!r} already exists; pass if_not_exists=True to "
                                "accept an existing table")
        con.execute(tdef.ddl())
        con.execute("INSERT INTO _expstore_tables (name, definition, version_group) "
                    "VALUES (?, ?, ?)", [name, tdef.to_json(), tdef.version_group])
        if tdef.version_group not in index.versions:
            con.execute("INSERT INTO _expstore_groups (name, version) VALUES (?, 0)",
                        [tdef.version_group])
            con.execute("INSERT INTO _expstore_versions (version_group, version) "
                        "VALUES (?, 0)", [tdef.version_group])
        return True

    def apply(created: bool) -> None:
        if created:
            index.add_table(tdef)

    return CallOp(run, apply)


def drop_table_op(index: StoreIndex, name: str, if_exists: bool) -> CallOp:
    """Drop table ``name`` and its rows, and its version group with its last member; the op's
    answer: whether it was dropped (false: there was none and ``if_exists`` accepted that).

    Raises (from the op):
        NotFound: no such table and ``if_exists`` is false.
    """
    def run(con: duckdb.DuckDBPyConnection) -> bool:
        live = index.live.get(name)
        if live is None:
            if if_exists:
                return False
            raise index.no_table(name)
        con.execute(f"DROP TABLE {quote(name)}")
        con.execute("DELETE FROM _expstore_tables WHERE name = ?", [name])
        group = live.tdef.version_group
        if not any(t.tdef.version_group == group for n, t in index.live.items() if n != name):
            con.execute("DELETE FROM _expstore_groups WHERE name = ?", [group])
            con.execute("DELETE FROM _expstore_versions WHERE version_group = ?", [group])
            con.execute("DELETE FROM _expstore_settings WHERE key = ?", [SETTING_PREFIX + group])
        return True

    def apply(dropped: bool) -> None:
        if dropped:
            index.drop_table(name)

    return CallOp(run, apply)
