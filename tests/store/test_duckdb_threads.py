"""DuckDB settings of a store: its threads (every core but one, or EXPSTORE_DUCKDB_THREADS), no
progress bar."""
from __future__ import annotations

import os

import pytest

import store
from store.errors import InvalidArgument


def _duckdb_threads(path: str) -> int:
    s = store.connect(path)
    try:
        return int(s._con.execute("SELECT current_setting('threads')").fetchone()[0])
    finally:
        s.close()


def test_duckdb_leaves_a_core_to_the_store_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv("EXPSTORE_DUCKDB_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert _duckdb_threads(str(tmp_path / "a.duckdb")) == max(1, cores - 1)
    monkeypatch.setenv("EXPSTORE_DUCKDB_THREADS", "3")
    assert _duckdb_threads(str(tmp_path / "a.duckdb")) == 3
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("EXPSTORE_DUCKDB_THREADS", bad)
        with pytest.raises(InvalidArgument, match=f"EXPSTORE_DUCKDB_THREADS='{bad}' is invalid"):
            store.connect(str(tmp_path / "a.duckdb"))
    monkeypatch.delenv("EXPSTORE_DUCKDB_THREADS")
    assert _duckdb_threads(str(tmp_path / "a.duckdb")) == max(1, cores - 1)  # nothing broken


def test_no_connection_of_the_store_draws_a_progress_bar(embedded_store):
    # A long query's bar went to the server's stderr, which is its log.
    s = embedded_store
    for cursor in (s._con, s._readers.cursor(), s._readers.cursor(materialize=False)):
        setting = cursor.execute("SELECT current_setting('enable_progress_bar')").fetchone()
        assert setting == (False,)
