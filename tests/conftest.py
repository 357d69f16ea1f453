"""Shared fixtures: real stores on DuckDB files in ``tmp_path``, no mocks.

``any_store`` is the store the behaviour tests run against. It is parametrized by backend, so the
same tests run against the embedded store and against a remote store talking to a real Flight
server over the same kind of file. Behaviour tests must therefore use only the public
:class:`store.Store` interface (docs/architecture.md). Tests of embedded-only mechanics (the blob
directory, reopening a file, ``gc``) use ``embedded_store`` / ``open_store`` instead.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterator

import pytest
from waiting import wait_until

import store

# "embedded-uncached": the same store with no claim cache (store/cache.py), so that claims read
# every row from DuckDB, as they do for rows put while a backlog fills the cache.
# "remote": a RemoteStore connected to a Flight server on a free loopback port.
BACKENDS = ["embedded", "embedded-uncached", "remote"]


@pytest.fixture
def db_path(tmp_path) -> str:
    """Path of a fresh DuckDB file (not created yet)."""
    return str(tmp_path / "x.duckdb")


@pytest.fixture(params=BACKENDS)
def any_store(request, tmp_path) -> Iterator[Any]:
    """A store implementing the public interface, on a fresh database, closed afterwards."""
    backend = request.param
    if backend == "remote":
        yield from _remote_store(tmp_path / "x.duckdb")
        return
    if backend == "embedded":
        s = store.connect(str(tmp_path / "x.duckdb"))
    elif backend == "embedded-uncached":
        s = store.connect(str(tmp_path / "x.duckdb"), cache_limit=0)
    else:  # pragma: no cover - a backend listed in BACKENDS without a branch here
        raise AssertionError(f"unknown store backend {backend!r}")
    try:
        yield s
    finally:
        s.close()


def _remote_store(db: Any) -> Iterator[Any]:
    """A RemoteStore over a real server on a fresh database; the server stops afterwards."""
    from flight_fixtures import running_server
    with running_server(db) as server:
        s = store.connect(server.location)
        # A subscription left open by a failed test keeps its stream, and so the server's
        # shutdown, waiting: close those before the server goes.
        subscriptions: list[Any] = []
        subscribe = s.subscribe

        def tracked(*args: Any, **kwargs: Any) -> Any:
            sub = subscribe(*args, **kwargs)
            subscriptions.append(sub)
            return sub

        s.subscribe = tracked
        try:
            yield s
        finally:
            for sub in subscriptions:
                sub.close()
            s.close()


# Logged changes (store/putlog.py) wait for a read, a materialize() or the close, never for a
# timer, so that a test sees them logged without racing the writer.
SLOW_INSERTS = {"materialize_delay": 3600.0, "lease_flush_delay": 3600.0}


@pytest.fixture
def slow_inserts(open_store) -> Callable[..., Any]:
    """``open_store`` with :data:`SLOW_INSERTS` (further options on top)."""
    return lambda path=None, **options: open_store(path, **{**SLOW_INSERTS, **options})


@pytest.fixture
def open_store(db_path) -> Iterator[Callable[..., Any]]:
    """Open (and later close) embedded stores; call it again after ``close()`` to reopen."""
    opened: list[Any] = []

    def _open(path: str | None = None, **options: Any) -> Any:
        s = store.connect(path or db_path, **options)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def embedded_store(open_store) -> Any:
    """The embedded store on a fresh file (for tests of embedded-only mechanics)."""
    return open_store()


_wait_until = wait_until


@pytest.fixture
def wait_until() -> Callable[..., Any]:
    """A bounded polling helper: ``wait_until(lambda: ..., timeout=5, message=...)``."""
    return _wait_until


# duckdb_engine (imported by the Alembic migrations) and torch in one process make nanobind
# print pages of "leaked instance" warnings at interpreter exit, after pytest's summary, which
# buries the result. Once pytest has finished everything, leave without that teardown.
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    session.config._expstore_exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    status = getattr(config, "_expstore_exit_status", None)
    if status is not None and os.environ.get("EXPSTORE_TEST_FAST_EXIT", "1") == "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
