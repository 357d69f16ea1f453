"""Helpers of the Flight tests: real servers on 127.0.0.1 port 0 over DuckDB files in tmp_path.

Every server here is the real :class:`flight_server.ExpstoreFlightServer` over a real DuckDB file,
served from a thread and shut down when its ``with`` block ends. Waits are bounded by deadlines.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time

from waiting import wait_until  # noqa: F401 - re-exported for the tests
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.flight as flight

from flight_server import ExpstoreFlightServer

TOKENS = {"reader": "reader-token-0001", "writer": "writer-token-0002",
          "admin": "admin-token-0003"}
WRONG_TOKEN = "not-a-valid-token-9999"


@contextlib.contextmanager
def running_server(db: Any, **options: Any) -> Iterator[ExpstoreFlightServer]:
    """Start a server on a free port over ``db`` (a path, or an open store that the caller
    closes); shut it down (and close the store it opened) on exit."""
    server = ExpstoreFlightServer(str(db) if isinstance(db, (str, os.PathLike)) else db,
                                  host="127.0.0.1", port=0, **options)
    thread = threading.Thread(target=server.serve, name="test-flight-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.close()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the Flight server did not stop within 30 s"


def write_tokens(path: Path) -> str:
    """A tokens file with one token per role (see flight_server.auth)."""
    doc = {"tokens": [{"token": t, "role": r, "name": f"{r}-test"} for r, t in TOKENS.items()]}
    path.write_text(json.dumps(doc))
    return str(path)


def bearer(token: str | None) -> flight.FlightCallOptions:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return flight.FlightCallOptions(headers=headers, timeout=30)


def self_signed_cert(directory: Path) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1/localhost and its key (PEM paths), via openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


# -- raw protocol helpers (pyarrow.flight + json only) --------------------------------------------
def action(client: flight.FlightClient, name: str, body: Any = None,
           options: flight.FlightCallOptions | None = None) -> list[bytes]:
    """Run a do_action; ``body`` is sent as JSON (bytes are sent as they are)."""
    raw = body if isinstance(body, bytes) else json.dumps(body if body is not None else {}).encode()
    results = client.do_action(flight.Action(name, raw), options or flight.FlightCallOptions())
    return [r.body.to_pybytes() for r in results]


def action_json(client: flight.FlightClient, name: str, body: Any = None,
                options: flight.FlightCallOptions | None = None) -> Any:
    return json.loads(action(client, name, body, options)[0])


def parse_claim(results: list[bytes]) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """A claim's answer: the JSON header, then one Arrow IPC stream per table in its order."""
    header = json.loads(results[0])
    tables = {name: pa.ipc.open_stream(pa.py_buffer(body)).read_all()
              for name, body in zip(header["tables"], results[1:])}
    assert len(results) == 1 + len(header["tables"])
    return header, tables


def query(client: flight.FlightClient, sql: str, params: list[Any] | None = None,
          options: flight.FlightCallOptions | None = None) -> pa.Table:
    ticket: dict[str, Any] = {"sql": sql}
    if params is not None:
        ticket["params"] = params
    reader = client.do_get(flight.Ticket(json.dumps(ticket).encode()),
                           options or flight.FlightCallOptions())
    return reader.read_all()


def put_batches(client: flight.FlightClient, table: str, batches: list[pa.RecordBatch],
                options: flight.FlightCallOptions | None = None) -> list[dict[str, Any]]:
    """One do_put stream; waits for each batch's answer before sending the next."""
    writer, answers = client.do_put(flight.FlightDescriptor.for_path(table), batches[0].schema,
                                    options or flight.FlightCallOptions())
    out = []
    try:
        for batch in batches:
            writer.write_batch(batch)
            buf = answers.read()
            assert buf is not None, "the server closed the put without answering a batch"
            out.append(json.loads(buf.to_pybytes()))
        writer.done_writing()
        assert answers.read() is None
    finally:
        writer.close()
    return out


def error_code(error: flight.FlightError) -> str | None:
    """The store error code a server put in a Flight error's ``extra_info``."""
    extra = error.extra_info
    return json.loads(bytes(extra))["code"] if extra else None
