"""Opening a database file: catalog revision checks, fresh catalogs, clear errors."""
from __future__ import annotations

import os
from typing import Any

import duckdb

from .errors import CatalogOutdated, InvalidArgument, StorageError, open_error


def duckdb_threads() -> int:
    """DuckDB's thread count: every core but one, at least one; ``EXPSTORE_DUCKDB_THREADS``
    overrides it.

    Why not all: the store's own threads (the writer, the server's gRPC threads receiving
    batches, the blob writes) need a core too, and most of DuckDB's work here is small
    transactions that gain nothing from waking a worker. On 2 cores, one DuckDB thread instead
    of two put narrow rows through the server faster and answered one-sample puts sooner
    (alternated runs; the figures are in docs/bench/history.md).
    """
    configured = _configured_threads()
    return configured if configured is not None else max(1, _cores() - 1)


def _configured_threads() -> int | None:
    """``EXPSTORE_DUCKDB_THREADS``, validated; None when unset."""
    raw = os.environ.get("EXPSTORE_DUCKDB_THREADS", "").strip()
    if not raw:
        return None
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise InvalidArgument(f"EXPSTORE_DUCKDB_THREADS={raw!r} is invalid; expected a "
                              "whole number of threads ≥ 1")
    return threads


def run_checkpoint(con: duckdb.DuckDBPyConnection) -> None:
    """Run a CHECKPOINT on every core (``EXPSTORE_DUCKDB_THREADS`` if set), then give DuckDB
    back its usual threads.

    Why every core: a checkpoint compresses the rows committed to the WAL into the database
    file, column by column, which DuckDB spreads over its threads (on 2 cores a checkpoint of
    narrow rows runs markedly faster on two threads than on one); and nothing else needs the
    core meanwhile, since the writer's own transactions wait for a checkpoint. ``threads`` is a
    global setting.
    """
    usual = duckdb_threads()
    threads = _configured_threads() or _cores()
    if threads != usual:
        con.execute(f"SET threads = {threads}")
    try:
        con.execute("CHECKPOINT")
    finally:
        if threads != usual:
            con.execute(f"SET threads = {usual}")


def invalidated(con: duckdb.DuckDBPyConnection, error: BaseException) -> bool:
    """Whether DuckDB invalidated the database (after a failed checkpoint or WAL write, e.g.
    a full disk): every statement fails until it is opened again. Asked of the database itself,
    not read from the error's text."""
    if isinstance(error, duckdb.FatalException):
        return True
    try:
        con.execute("SELECT 1").fetchall()
    except duckdb.Error:
        return True
    return False


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def duckdb_config(memory_limit: str | None) -> dict[str, Any]:
    """The configuration every store connection uses.

    External access stays off for the whole database so that no query can read files, attach
    databases or load extensions, whatever the SQL guard lets through. DuckDB's automatic
    checkpoint is pushed out: the writer checkpoints when idle, or when the WAL reaches
    ``StoreSettings.wal_checkpoint_bytes``, between two groups and on every core (see
    checkpoints.py); DuckDB's own, at a threshold above that, is left for a checkpoint the writer could not run.
    """
    config: dict[str, Any] = {
        "enable_external_access": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "allow_community_extensions": False,
        "checkpoint_threshold": "1GB",
        "threads": duckdb_threads(),
    }
    if memory_limit:
        config["memory_limit"] = memory_limit
    return config


def check_memory_limit(memory_limit: str | None) -> None:
    """Refuse a memory limit DuckDB would not take, before any file is created: DuckDB only
    parses it when the database opens, and by then the catalog is already written.

    Raises:
        InvalidArgument: naming the value and the spellings DuckDB takes.
    """
    if not memory_limit:
        return
    try:
        duckdb.connect(":memory:", config={"memory_limit": memory_limit}).close()
    except duckdb.Error as e:
        raise InvalidArgument(f"memory_limit {memory_limit!r} is invalid ({e}); expected a size "
                              "such as 4GB or 512MiB, or a share of the machine's memory such as "
                              "80%") from None


def connect_duckdb(path: str, memory_limit: str | None) -> duckdb.DuckDBPyConnection:
    try:
        con = duckdb.connect(path, config=duckdb_config(memory_limit))
    except duckdb.Error as e:
        raise open_error(path, e) from e
    # A query over 2 s drew DuckDB's progress bar on the server's stderr (its log). The setting
    # is per connection (not allowed in the config), and cursors made later inherit it.
    con.execute("SET enable_progress_bar = false")
    return con


def catalog_revision(path: str) -> str | None:
    """The catalog's Alembic revision, or None for a database without a catalog."""
    if not os.path.exists(path):
        return None
    try:
        con = duckdb.connect(path, config=duckdb_config(None))
    except duckdb.Error as e:
        raise open_error(path, e) from e
    try:
        has = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = "
                          "'alembic_version'").fetchone()
        if not has or not has[0]:
            tables = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE "
                                 "'\\_expstore%' ESCAPE '\\'").fetchone()
            if tables and tables[0]:
                raise CatalogOutdated(f"database {path!r} has expstore tables but no migration "
                                      "stamp; run `expstore migrate` on it")
            return None
        row = con.execute("SELECT version_num FROM alembic_version").fetchone()
        return row[0] if row else None
    finally:
        con.close()


def ensure_catalog(path: str) -> None:
    """Create the catalog of a new database; refuse one at another revision."""
    if path == ":memory:" or not path:
        raise InvalidArgument(f"database path {path!r} is not a file path; the store needs a file "
                              "(e.g. ./expstore.duckdb)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise StorageError(f"directory {directory!r} of database {path!r} does not exist")
    import migrations  # local: alembic is only needed when opening

    revision = catalog_revision(path)
    head = migrations.head()
    if revision is None:
        try:
            migrations.upgrade(path)
        except Exception as e:  # noqa: BLE001 - alembic raises many kinds
            raise StorageError(f"cannot create the catalog of {path!r}: {e}") from e
        return
    if revision == head:
        return
    if revision in migrations.known_revisions():
        raise CatalogOutdated(f"the catalog of {path!r} is at revision {revision!r}, older than "
                              f"this expstore's {head!r}; run `expstore migrate --db {path}`")
    raise CatalogOutdated(f"the catalog of {path!r} is at revision {revision!r}, which this "
                          f"expstore does not know (it knows up to {head!r}); the database was "
                          "written by a newer expstore: upgrade expstore")
