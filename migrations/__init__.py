"""Alembic migrations of the store's catalog (tables, version groups, versions, settings).

Each verb is a plain function, callable from code as well as from ``expstore migrate``:

>>> upgrade("./expstore.duckdb")          # doctest: +SKIP
"""
from __future__ import annotations

import os
from functools import lru_cache

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

HERE = os.path.dirname(os.path.abspath(__file__))


def _config(db_path: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", HERE)
    cfg.set_main_option("sqlalchemy.url", f"duckdb:///{db_path}")
    return cfg


@lru_cache(maxsize=1)
def head() -> str:
    """The newest revision this version of expstore knows."""
    script = ScriptDirectory(HERE)
    heads = script.get_heads()
    assert len(heads) == 1, f"migrations have several heads: {heads}"
    return heads[0]


@lru_cache(maxsize=1)
def known_revisions() -> tuple[str, ...]:
    script = ScriptDirectory(HERE)
    return tuple(r.revision for r in script.walk_revisions())


def upgrade(db_path: str, revision: str = "head") -> None:
    """Upgrade the catalog of the database at ``db_path`` to ``revision``.

    Raises:
        StorageError: the file cannot be opened or written (the cause in DuckDB's words, not
            SQLAlchemy's wrapping of it).
        alembic.util.CommandError: ``revision`` is unknown.
    """
    from sqlalchemy.exc import DBAPIError

    try:
        command.upgrade(_config(db_path), revision)
    except DBAPIError as e:
        from store.errors import open_error
        raise open_error(db_path, e.orig if e.orig is not None else e) from e


def downgrade(db_path: str, revision: str) -> None:
    command.downgrade(_config(db_path), revision)
