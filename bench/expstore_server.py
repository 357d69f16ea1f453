"""The expstore server the ``expstore_*`` benchmarks and the simulation talk to.

Started once per run (``python -m flight_server --db PATH --port PORT`` in a temporary folder,
readiness polled on the port) and stopped when the run ends; or ``--store-uri`` points the
benchmarks at a server that is already running (then its memory is not measured). Until the
``store`` and ``flight_server`` packages exist, everything here raises ``Skip`` saying so.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.context import Ctx, Skip
from bench.util import HOST, free_port, tree_rss_mb, wait_port

REPO = Path(__file__).resolve().parent.parent
_server: dict[str, object] = {}
_names = itertools.count()


def require_store() -> None:
    """Raise ``Skip`` unless ``store.connect`` can be imported."""
    try:
        store = importlib.import_module("store")
    except ImportError as e:
        raise Skip(f"the store package cannot be imported yet ({e})") from e
    if not hasattr(store, "connect"):
        raise Skip("store.connect does not exist yet")


def _require_server() -> None:
    if importlib.util.find_spec("flight_server") is None or \
            importlib.util.find_spec("flight_server.__main__") is None:
        raise Skip("flight_server has no __main__ yet (python -m flight_server)")


def uri(ctx: Ctx) -> str:
    """The ``grpc://`` address of the run's server, starting it on first use."""
    require_store()
    if ctx.store_uri:
        return ctx.store_uri
    if "uri" in _server:
        check_alive()
        return str(_server["uri"])
    _require_server()
    tmp = tempfile.mkdtemp(prefix="bench-expstore-")
    port = free_port()
    log = open(Path(tmp, "server.log"), "wb")  # noqa: SIM115 - closed by _stop
    # PYTHONFAULTHANDLER: a crash of the server leaves its threads' tracebacks in the log
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flight_server", "--db", str(Path(tmp, "bench.duckdb")),
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        # keep the server's log: a benchmark that failed midway is explained there
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp, "server.log"), ctx.out_dir / "expstore-server.log")
        shutil.rmtree(tmp, ignore_errors=True)
        _server.clear()

    try:
        wait_port(port, timeout=60, alive=lambda: proc.poll() is None)
    except RuntimeError as e:
        log.flush()
        tail = Path(tmp, "server.log").read_text(errors="replace")[-2000:]
        stop()
        raise Skip(f"expstore server did not start: {e}\n{tail}") from e
    _server.update(uri=f"grpc://{HOST}:{port}", pid=proc.pid, proc=proc)
    ctx.cleanup.append(stop)
    return str(_server["uri"])


def check_alive() -> None:
    """Raise if the server this run started has exited (its log is kept in the out folder)."""
    proc = _server.get("proc")
    if proc is not None and proc.poll() is not None:  # type: ignore[attr-defined]
        raise RuntimeError(f"the expstore server exited with code {proc.returncode}; "  # type: ignore[attr-defined]
                           "see expstore-server.log in the out folder")


def rss_mb() -> float | None:
    """Resident memory of the server this run started (None for ``--store-uri``)."""
    pid = _server.get("pid")
    return tree_rss_mb(pid) if isinstance(pid, int) else None


def table_name(prefix: str) -> str:
    """A table name no earlier benchmark of this run (or of a reused server) has used."""
    return f"bench_{prefix}_{os.getpid()}_{next(_names)}"
