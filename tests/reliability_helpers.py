"""Shared machinery of the reliability suite (tests/reliability/, scripts/soak.py,
scripts/crash_loop.py): a real server in a subprocess, SIGKILL, RSS, checksums.

The server runs in its own process so that a test can ``kill -9`` it. It is started with
``python -m flight_server --db PATH --port PORT`` (the command users run), created by
``subprocess`` (fork + exec: nothing of this process's gRPC state survives into it), and
readiness is a bounded poll of the ``health`` action, never a sleep.

Every wait here has a deadline; every loop a bound.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from waiting import wait_until  # noqa: F401 - re-exported for the tests
from pathlib import Path
from typing import Any

import pyarrow.flight as flight

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """An expstore Flight server in a subprocess on a fixed port, restartable on the same files.

    >>> srv = ServerProcess("/tmp/x.duckdb")        # doctest: +SKIP
    >>> srv.start(); srv.kill(); srv.start()        # doctest: +SKIP
    """

    def __init__(self, db: str | os.PathLike, *, port: int | None = None,
                 memory_limit: str | None = None, cache_limit: str | None = None,
                 max_live_rows: int | None = None,
                 log_path: str | os.PathLike | None = None) -> None:
        self.db = str(db)
        self.port = port or free_port()
        self.memory_limit = memory_limit
        self.cache_limit = cache_limit
        self.max_live_rows = max_live_rows
        self.log_path = Path(log_path or f"{self.db}.server.log")
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.last_start_seconds = 0.0

    @property
    def uri(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def _command(self) -> list[str]:
        cmd = [sys.executable, "-m", "flight_server", "--db", self.db, "--port", str(self.port)]
        if self.memory_limit:
            cmd += ["--memory-limit", self.memory_limit]
        if self.cache_limit:
            cmd += ["--cache-limit", self.cache_limit]
        if self.max_live_rows:
            cmd += ["--max-live-rows", str(self.max_live_rows)]
        return cmd

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        """Start the server and wait until it answers ``health`` (bounded by ``timeout``)."""
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        t0 = time.monotonic()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self._command(), cwd=str(ROOT), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()
        self.starts += 1
        self._wait_ready(timeout)
        self.last_start_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting; "
                                   f"log:\n{self.log_tail()}")
            if health(self.uri, timeout=1.0) is not None:
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server on {self.uri} not ready within {timeout} s; log:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (the crash under test) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a clean shutdown); SIGKILL if it does not exit within ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int | None:
        """The server's resident set size (VmRSS), or None if it is gone."""
        return rss_bytes(self.pid) if self.alive() else None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process from /proc (bytes), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def health(uri: str, timeout: float = 2.0) -> dict | None:
    """The ``health`` action's answer, or None if the server does not answer in time."""
    try:
        client = flight.FlightClient(uri)
    except Exception:  # noqa: BLE001 - not listening yet
        return None
    try:
        options = flight.FlightCallOptions(timeout=timeout)
        results = list(client.do_action(flight.Action("health", b"{}"), options))
        return json.loads(results[0].body.to_pybytes())
    except Exception:  # noqa: BLE001 - any failure means "not healthy (yet)"
        return None
    finally:
        client.close()


def table_checksum_sql(table: str, columns: list[str]) -> str:
    """One SELECT giving (rows, distinct keys, an order-independent hash of every column given)."""
    quoted = ", ".join(f'"{c}"' for c in columns)
    return (f'SELECT count(*) AS n, count(DISTINCT (sample_id, policy_version)) AS keys, '
            f'coalesce(sum(hash({quoted})), 0)::VARCHAR AS h FROM "{table}"')


def rows_and_keys(s: Any, table: str) -> tuple[int, int]:
    """A table's SQL rows and distinct (sample_id, policy_version) keys. Tables declare no key:
    the store alone keeps them unique, so the two must be equal."""
    row = s.query(f'SELECT count(*) AS n, count(DISTINCT (sample_id, policy_version)) AS keys '
                  f'FROM "{table}"').to_pylist()[0]
    return row["n"], row["keys"]


def store_checksum(s: Any, extra_meta: tuple[str, ...] = (
        "sample_id", "policy_version", "finished_version", "is_processing", "lease_id",
        "delivery_count", "consumed", "stale", "dead")) -> dict[str, tuple]:
    """Checksum of every table (rows, distinct keys, hash over meta, data and status columns),
    plus each table's version, through any store (embedded or remote)."""
    out: dict[str, tuple] = {}
    for name in s.list_tables():
        d = s.describe(name)
        data = [c["name"] for c in d["columns"]]
        cols = list(extra_meta) + data + [f"{c}_status" for c in data]
        # A by-reference column's value is NULL in DuckDB; its key column carries the identity.
        cols += [f"{c['name']}__ref" for c in d["columns"]
                 if c.get("storage", "auto") != "value" and _complex(c["type"])]
        row = s.query(table_checksum_sql(name, cols)).to_pylist()[0]
        # Tables declare no key: the store alone keeps them unique (see rows_and_keys).
        assert row["n"] == row["keys"], f"{name}: {row['n']} rows for {row['keys']} keys"
        out[name] = (row["n"], row["keys"], row["h"], d["version"])
    return out


def _complex(type_spelling: str) -> bool:
    t = str(type_spelling)
    return t in ("string", "binary") or t.startswith(("list", "tensor"))


def sample_ids(prefix: str, start: int, count: int, turn: int = 0, traj: int = 0) -> list[str]:
    return [f"{prefix}{i}_{turn}_{traj}" for i in range(start, start + count)]


def reward_of(sample_id: str) -> float:
    """A deterministic value per sample, so a row read back can be checked, not just counted."""
    return float(sum(map(ord, sample_id)) % 997) / 7.0


def response_of(sample_id: str, big: bool) -> str:
    """Short (by value) or long (by reference, > 512 bytes) text derived from the id."""
    return (sample_id + "|") * (80 if big else 1)


def inject_writer_bug(monkeypatch: Any, s: Any) -> None:
    """Make an embedded store's writer thread fail on its next group, as a bug in it would."""
    def broken(*args: Any, **kwargs: Any) -> None:   # whatever _run_group takes
        raise RuntimeError("injected writer bug")

    monkeypatch.setattr(s._writer, "_run_group", broken)  # noqa: SLF001
