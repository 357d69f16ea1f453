"""End to end: the server as a separate process (``python -m flight_server`` and
``expstore serve``), used through ``store.connect("grpc://…")`` and the CLI's ``--uri``, stopped
with SIGTERM / SIGINT; the data must still be there when the file is reopened embedded.

Readiness is the server's one "expstore serving …" line, read from its stdout with a deadline.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Iterator

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from click.testing import CliRunner

import store
from store.errors import TableFull
from expstore.cli import cli
from flight_server.server import ExpstoreFlightServer
from test_flight_session import RawSession
from test_session_puts import ipc, send_put
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


_numbers = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess whose stdout lines arrive on a queue (read by a thread)."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
        for name in ("EXPSTORE_DB", "EXPSTORE_URI", "EXPSTORE_TOKEN"):
            env.pop(name, None)
        self.stderr_path = cwd / f"server-{next(_numbers)}.stderr"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> str:
        """The ready line; fails with the server's stderr if it does not come in time."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                line = ""
            if line and line.startswith("expstore serving "):
                return line
            if line is None or remaining <= 0:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server not ready (exit {self.proc.returncode}); stderr:\n"
                                     f"{self.stderr_path.read_text()}")

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not stop on {signal.Signals(sig).name}; stderr:\n"
                                 f"{self.stderr_path.read_text()}")

    def remaining_stdout(self) -> list[str]:
        self._reader.join(timeout=10)
        out = []
        while True:
            line = self.lines.get_nowait() if not self.lines.empty() else None
            if line is None:
                return out
            out.append(line)

    def close(self) -> None:
        if self.proc.poll() is None:  # a failed test: do not leave the server behind
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture
def start_server(tmp_path) -> Iterator:
    started: list[ServerProcess] = []

    def _start(*args: str) -> ServerProcess:
        server = ServerProcess(list(args), tmp_path)
        started.append(server)
        return server

    yield _start
    for server in started:
        server.close()


def cli_json(*args: str) -> object:
    result = CliRunner().invoke(cli, [*args, "--json"],
                                env={"EXPSTORE_DB": None, "EXPSTORE_URI": None})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_python_m_flight_server_end_to_end(start_server, tmp_path):
    db = tmp_path / "x.duckdb"
    port = free_port()
    server = start_server("-m", "flight_server", "--db", str(db), "--port", str(port))
    line = server.wait_ready()
    uri = f"grpc://127.0.0.1:{port}"
    assert line == f"expstore serving {uri} (db {db})"

    with store.connect(uri) as s:
        s.create_table("solver", {"prompt": "string", "reward": "float64"})
        s.put("solver", [{"sample_id": f"q{i}_0_0", "prompt": f"p{i}", "reward": float(i)}
                         for i in range(10)])
        done = s.claim("solver", 4, consumer="trainer-0", lease_seconds=600)
        assert done.data.num_rows == 4
        assert s.ack(done.claim_id)["acked"] == 4
        open_claim = s.claim("solver", 2, consumer="trainer-1", lease_seconds=600)

    # The CLI against the running server.
    assert cli_json("tables", "--uri", uri) == ["solver"]
    stats = cli_json("stats", "solver", "--uri", uri)
    assert stats["solver"]["consumed"] == 4 and stats["solver"]["processing"] == 2
    leases = cli_json("leases", "--uri", uri)
    assert [lease["claim_id"] for lease in leases] == [open_claim.claim_id]
    assert cli_json("query", "SELECT count(*) AS n FROM solver WHERE consumed", "--uri", uri) \
        == [{"n": 4}]
    assert cli_json("version", "bump", "solver", "--weights-uri", "file:///ckpt/1",
                    "--uri", uri)["version"] == 1
    export = tmp_path / "solver.parquet"
    assert cli_json("export", "solver", "-o", str(export), "--uri", uri)["rows"] == 10

    # While the server owns the file, the embedded path is refused with a hint, not a traceback.
    locked = CliRunner().invoke(cli, ["tables", "--db", str(db)], env={"EXPSTORE_URI": None})
    assert locked.exit_code == 1 and "Traceback" not in locked.output
    assert "in use by another process" in locked.output and "--uri" in locked.output

    assert server.stop(signal.SIGTERM) == 0
    assert server.remaining_stdout() == []  # exactly one line on stdout: the ready line
    # nothing from interpreter teardown either (nanobind's "leaked …" pages)
    assert "leaked" not in server.stderr_path.read_text()

    with store.connect(str(db)) as s:
        assert s.list_tables() == ["solver"]
        assert s.get_version("solver") == 1
        assert s.weights_uri("solver") == "file:///ckpt/1"
        counts = s.query("SELECT count(*) AS n, count(*) FILTER (WHERE consumed) AS consumed "
                         "FROM solver").to_pylist()
        assert counts == [{"n": 10, "consumed": 4}]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_stops_on_a_signal_while_a_client_holds_a_session_open(start_server, tmp_path,
                                                                      sig):
    """A client's open session (claims, acks, small puts) must not hold the server up: the
    server tells it to close, the client gets a clear error, the data written is kept."""
    db = tmp_path / "s.duckdb"
    server = start_server("-m", "flight_server", "--db", str(db), "--port", "0")
    uri = server.wait_ready().split()[2]
    s = store.connect(uri)
    try:
        s.create_table("t", {"a": "int64"})
        s.put("t", {"sample_id": ["q1_0_0", "q2_0_0", "q3_0_0"], "a": [1, 2, 3]})  # session
        claim = s.claim("t", 2)  # on the session too
        s.ack(claim.claim_id)
        started = time.monotonic()
        assert server.stop(sig) == 0
        assert time.monotonic() - started < 20
        with pytest.raises(store.errors.Unavailable):
            s.claim("t", 1)
    finally:
        s.close()
    assert "Traceback" not in server.stderr_path.read_text()
    with store.connect(str(db)) as e:
        assert e.query("SELECT a, consumed FROM t ORDER BY a").to_pylist() == [
            {"a": 1, "consumed": True}, {"a": 2, "consumed": True}, {"a": 3, "consumed": False}]


def _deaf_session(uri: str) -> RawSession:
    """A session opened with plain pyarrow that puts one row, then neither reads its answers
    nor ends its stream: a frozen client, or one that ignores the "closing" message."""
    session = RawSession(flight.FlightClient(uri))
    rows = pa.table({"sample_id": ["deaf_0_0"], "a": pa.array([7], pa.int64())})
    send_put(session, 1, {"table": "t"}, [ipc(rows)])
    return session


def _deaf_subscriber(uri: str) -> tuple:
    """A subscription opened with plain pyarrow whose micro-batches are never read and whose
    stream is never ended (after the server's "closing" message either)."""
    client = flight.FlightClient(uri)
    command = json.dumps({"subscribe": {"table": "t", "micro_batch_size": 1,
                                        "global_batch_size": 2}})
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command.encode()))
    return client, writer, reader


def _wait_for_rows(uri: str, n: int) -> None:
    with store.connect(uri) as s:
        wait_until(lambda: s.query("SELECT count(*) AS n FROM t").to_pylist()[0]["n"] >= n,
                   30, "the deaf client's put arrived")


@pytest.mark.parametrize("deaf_client", ["session", "subscriber"])
def test_a_client_that_never_ends_its_stream_holds_the_shutdown_only_for_the_grace(
        start_server, tmp_path, deaf_client):
    """gRPC waits for every open call, and a session or subscription ends only when its client
    ends it: a client that does not would hold the server up for ever. After --shutdown-grace
    the store is closed without it, and every row the server acknowledged is in the file."""
    db = tmp_path / "g.duckdb"
    server = start_server("-m", "flight_server", "--db", str(db), "--port", "0",
                          "--shutdown-grace", "1")
    uri = server.wait_ready().split()[2]
    with store.connect(uri) as s:
        s.create_table("t", {"a": "int64"})
        s.put("t", {"sample_id": ["q1_0_0", "q2_0_0"], "a": [1, 2]})
    if deaf_client == "session":
        deaf = _deaf_session(uri)
        _wait_for_rows(uri, 3)
        expected = [1, 2, 7]
        held_up = ("stopping without waiting for the calls still open after the 1 s grace (1 of "
                   "them action sessions whose client did not end its stream when told to)")
    else:
        deaf = _deaf_subscriber(uri)
        with store.connect(uri) as s:  # the subscription leased its first micro-batch
            wait_until(lambda: s.leases("t"), 30, "the subscription got a micro-batch")
        expected = [1, 2]
        held_up = "stopping without waiting for the calls still open after the 1 s grace;"
    started = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 20
    stderr = server.stderr_path.read_text()
    assert held_up in stderr, stderr
    assert "Traceback" not in stderr
    del deaf
    with store.connect(str(db)) as e:
        assert [r["a"] for r in e.query("SELECT a FROM t ORDER BY a").to_pylist()] == expected


def test_long_polls_end_at_a_signal_instead_of_holding_the_shutdown(start_server, tmp_path):
    """A producer's wait_version and a trainer's barrier arrival wait up to 300 s on the
    server, and people's SQL runs up to the query time limit; a stop must end them with
    Unavailable (their clients call again once the server is back), not wait for them until
    the grace ends and log that it could not."""
    db = tmp_path / "w.duckdb"
    # A grace and a query limit far past STOP_TIMEOUT: a server that waited for the polls or
    # the query fails server.stop.
    server = start_server("-m", "flight_server", "--db", str(db), "--port", "0",
                          "--shutdown-grace", str(10 * STOP_TIMEOUT),
                          "--set", f"query_timeout={10 * STOP_TIMEOUT}")
    uri = server.wait_ready().split()[2]
    with store.connect(uri) as s:
        for table in ("planner", "verifier"):
            s.create_table(table, {"a": "int64"}, version_group="team")
    polls = {"wait_version": {"table": "planner", "min_version": 5, "timeout": 300},
             "arrive": {"tables": ["planner"], "expected": 0, "timeout": 300}}
    outcomes: dict[str, BaseException] = {}

    def poll(name: str) -> None:
        client = flight.FlightClient(uri)
        try:
            if name == "query":
                heavy = "SELECT count(*) FROM range(100000000000) t(i) WHERE hash(i) % 7 = 3"
                client.do_get(flight.Ticket(json.dumps({"sql": heavy}).encode())).read_all()
            else:
                list(client.do_action(flight.Action(name, json.dumps(polls[name]).encode())))
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            outcomes[name] = e

    polls["query"] = {}
    threads = [threading.Thread(target=poll, args=(name,), daemon=True) for name in polls]
    for thread in threads:
        thread.start()
    with store.connect(uri) as s:
        wait_until(lambda: s.barrier("planner")["arrived"] == ["planner"], 30,
                   "the arrival reached the server")
    assert server.stop(signal.SIGTERM) == 0
    for thread in threads:
        thread.join(STOP_TIMEOUT)
    for name in polls:
        assert isinstance(outcomes.get(name), flight.FlightUnavailableError), outcomes
        assert "shutting down" in str(outcomes[name]), outcomes[name]
    stderr = server.stderr_path.read_text()
    assert "stopping without waiting" not in stderr and "Traceback" not in stderr


def test_a_second_signal_stops_without_waiting_for_the_grace(start_server, tmp_path):
    db = tmp_path / "h.duckdb"
    # A grace far past STOP_TIMEOUT: a server that waited for it fails server.stop below
    # ("did not stop on SIGINT"), however slowly or quickly this machine runs.
    server = start_server("-m", "expstore.cli", "serve", "--db", str(db), "--port", "0",
                          "--shutdown-grace", str(10 * STOP_TIMEOUT))
    uri = server.wait_ready().split()[2]
    with store.connect(uri) as s:
        s.create_table("t", {"a": "int64"})
    deaf = _deaf_session(uri)
    _wait_for_rows(uri, 1)
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping on SIGTERM" in server.stderr_path.read_text(), timeout=60,
               message="the server taking the first signal")
    assert server.stop(signal.SIGINT) == 0
    assert "after a second signal" in server.stderr_path.read_text()
    del deaf
    with store.connect(str(db)) as e:
        assert e.query("SELECT a FROM t").to_pylist() == [{"a": 7}]


@pytest.mark.slow
def test_server_survives_many_stops_with_a_session_open(start_server, tmp_path):
    """Crash loop: stopping with a session open once crashed the process now and then ("double
    free or corruption", about 1 stop in 30: a pool thread that still held the session destroyed
    pyarrow's reader and writer after their call was gone). Each stop must exit 0."""
    for i in range(60):
        db = tmp_path / f"c{i}.duckdb"
        server = start_server("-m", "flight_server", "--db", str(db), "--port", "0")
        s = store.connect(server.wait_ready().split()[2])
        try:
            s.create_table("t", {"a": "int64"})
            s.put("t", {"sample_id": ["q1_0_0", "q2_0_0"], "a": [1, 2]})
            s.ack(s.claim("t", 1).claim_id)
            rc = server.stop(signal.SIGINT if i % 2 else signal.SIGTERM)
            assert rc == 0, f"stop {i} exited {rc}: {server.stderr_path.read_text()[-2000:]}"
        finally:
            s.close()


def test_expstore_serve_stops_on_sigint(start_server, tmp_path):
    db = tmp_path / "y.duckdb"
    server = start_server("-m", "expstore.cli", "serve", "--db", str(db), "--port", "0")
    line = server.wait_ready()
    assert line.startswith("expstore serving grpc://127.0.0.1:") and line.endswith(f"(db {db})")
    uri = line.split()[2]

    with store.connect(uri) as s:
        s.create_table("t", {"a": "int64"})
        s.put("t", {"sample_id": ["q1_0_0", "q2_0_0"], "a": [1, 2]})
    assert cli_json("describe", "t", "--uri", uri)["name"] == "t"

    assert server.stop(signal.SIGINT) == 0
    assert "Traceback" not in server.stderr_path.read_text()

    rows = CliRunner().invoke(cli, ["query", "SELECT a FROM t ORDER BY a", "--db", str(db),
                                    "--json"], env={"EXPSTORE_URI": None})
    assert rows.exit_code == 0, rows.output
    assert json.loads(rows.stdout) == [{"a": 1}, {"a": 2}]


def test_serve_refuses_a_locked_database(start_server, tmp_path):
    db = tmp_path / "z.duckdb"
    first = start_server("-m", "flight_server", "--db", str(db), "--port", "0")
    first.wait_ready()
    second = start_server("-m", "flight_server", "--db", str(db), "--port", "0")
    assert second.proc.wait(timeout=READY_TIMEOUT) == 1
    err = second.stderr_path.read_text()
    assert "in use by another process" in err and "Traceback" not in err
    assert "See also http" not in err  # DuckDB's documentation link is not the operator's cause
    assert "stop it first" in err      # a second serve cannot use --uri instead
    # migrate has no --uri: its message says what it needs, not to connect to the server
    migrate = CliRunner().invoke(cli, ["migrate", "--db", str(db)], env={"EXPSTORE_URI": None})
    assert migrate.exit_code == 1 and "Traceback" not in migrate.output
    assert "in use by another process" in migrate.output
    assert "stop it first for expstore migrate" in migrate.output
    assert first.stop(signal.SIGTERM) == 0


# -- a server that cannot start says why, in one line ------------------------------------------
def _refused_start(start_server, tmp_path: Path, *args: str) -> str:
    """Start ``expstore serve`` expecting it to refuse; its stderr, checked for gRPC's noise."""
    server = start_server("-m", "expstore.cli", "serve", "--db", str(tmp_path / "s.duckdb"),
                          *args)
    assert server.proc.wait(timeout=READY_TIMEOUT) == 1
    err = server.stderr_path.read_text()
    for noise in ("Server did not start properly", "Traceback", "absl", "add_port.cc"):
        assert noise not in err, err
    assert len([line for line in err.splitlines() if line.startswith("Error: ")]) == 1, err
    return err


def test_serve_on_a_port_in_use_names_it(start_server, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _refused_start(start_server, tmp_path, "--port", str(port))
    assert f"port {port} on 127.0.0.1 is in use" in err and "--port" in err


def test_serve_on_a_metrics_port_in_use_names_it(start_server, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _refused_start(start_server, tmp_path, "--port", "0", "--metrics-port", str(port))
    assert f"port {port} on 127.0.0.1 is in use" in err and "--metrics-port" in err, err


def test_a_server_whose_metrics_port_is_taken_releases_its_store(tmp_path):
    db = str(tmp_path / "m.duckdb")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            ExpstoreFlightServer(db, host="127.0.0.1", port=0,
                                 metrics_port=busy.getsockname()[1])
    # Another process can open the file: the failed server left no lock on it.
    subprocess.run([sys.executable, "-c", f"import store; store.connect({db!r}).close()"],
                   check=True, timeout=60)


def test_serve_on_an_address_of_another_machine_names_it(start_server, tmp_path):
    # 192.0.2.1: TEST-NET-1 (RFC 5737), never an address of this machine
    err = _refused_start(start_server, tmp_path, "--host", "192.0.2.1", "--port", "0")
    assert "--host 192.0.2.1 is not an address of this machine" in err


@pytest.mark.parametrize("cert, key, cause", [
    ("garbage", "key", "holds no PEM certificate"),
    ("cert", "garbage", "holds no PEM private key"),
    ("cert", "other-key", "is not the key of --tls-cert"),
    ("cert", "cert", "holds no PEM private key"),
])
def test_serve_with_an_unusable_tls_certificate_or_key_names_it(start_server, tmp_path, cert,
                                                                  key, cause):
    from flight_fixtures import self_signed_cert
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files = dict(zip(("cert", "key"), self_signed_cert(tmp_path / "a")))
    files["other-key"] = self_signed_cert(tmp_path / "b")[1]
    files["garbage"] = str(tmp_path / "garbage.pem")
    Path(files["garbage"]).write_text("not a PEM file\n")
    err = _refused_start(start_server, tmp_path, "--port", "0", "--tls-cert", files[cert],
                         "--tls-key", files[key])
    assert "TLS cannot start" in err and cause in err, err


def test_serve_takes_the_cache_and_live_row_limits(start_server, tmp_path):
    server = start_server("-m", "expstore.cli", "serve", "--db", str(tmp_path / "l.duckdb"),
                          "--port", "0", "--cache-limit", "64MiB", "--max-live-rows", "2")
    uri = server.wait_ready().split()[2]
    with store.connect(uri) as s:
        assert s.health()["claim_cache_limit"] == 64 << 20
        s.create_table("t", {"a": "int64"})
        s.put("t", {"sample_id": ["q1_0_0", "q2_0_0"], "a": [1, 2]})
        with pytest.raises(TableFull, match="max_live_rows of 2"):
            s.put("t", {"sample_id": ["q3_0_0"], "a": [3]})
    assert server.stop(signal.SIGTERM) == 0


def test_serve_takes_any_store_setting_through_set(start_server, tmp_path):
    server = start_server("-m", "expstore.cli", "serve", "--db", str(tmp_path / "s.duckdb"),
                          "--port", "0", "--set", "cache_limit=32MiB", "--set",
                          "max_live_rows=1", "--set", "query_timeout=7")
    uri = server.wait_ready().split()[2]
    with store.connect(uri) as s:
        assert s.health()["claim_cache_limit"] == 32 << 20  # --set wins over --cache-limit's default
        s.create_table("t", {"a": "int64"})
        s.put("t", {"sample_id": ["q1_0_0"], "a": [1]})
        with pytest.raises(TableFull, match="max_live_rows of 1"):
            s.put("t", {"sample_id": ["q2_0_0"], "a": [2]})
    assert server.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize("pair, named", [("no_such_knob=1", "no_such_knob"),
                                         ("query_timeout=-1", "query_timeout")])
def test_serve_refuses_a_bad_set_before_it_opens_anything(tmp_path, pair, named):
    db = tmp_path / "never.duckdb"
    result = CliRunner().invoke(cli, ["serve", "--db", str(db), "--port", "0", "--set", pair])
    assert result.exit_code == 2, result.output
    assert "--set" in result.output and named in result.output
    assert "Traceback" not in result.output and not db.exists()
