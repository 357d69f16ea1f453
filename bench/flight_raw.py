"""Baseline: the raw Arrow Flight loopback limit, from a trivial in-memory server.

The server (a spawned subprocess on a port the OS picks) keeps what it is sent in memory:
``do_put`` answers every batch with a metadata message, ``do_get`` streams a stored table back,
the action ``row`` deserialises a one-row IPC stream and echoes it (the cheapest useful
round trip: what a claim or a one-sample put can at best cost), and ``do_exchange`` answers each
message with a stored table's first batch (what a micro-batch on an open session at best costs). Paths starting with ``sink``
are counted and dropped, so throughput runs do not fill memory.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from bench.context import Ctx
from bench.load import run_load
from bench.util import HOST, median_rate, percentiles_ms, spawn_context, time_calls, wait_port
from bench.workloads import BATCH_ROWS, mb, narrow_table, rebatch, wide_table

NAME = "flight_raw"
TITLE = "raw Arrow Flight loopback (in-memory server)"


class RawServer(flight.FlightServerBase):
    """The trivial server. Not a pattern for production: no auth, no durability, no limits."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self._lock = threading.Lock()
        self._tables: dict[bytes, list[pa.RecordBatch]] = {}

    def do_put(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any,
               writer: Any) -> None:
        path = descriptor.path[0] if descriptor.path else b""
        keep = not path.startswith(b"sink")
        batches, rows = [], 0
        for chunk in reader:
            rows += chunk.data.num_rows
            if keep:
                batches.append(chunk.data)
            writer.write(pa.py_buffer(b'{"rows":%d}' % rows))
        if keep:
            with self._lock:
                self._tables[path] = batches

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        with self._lock:
            batches = self._tables[ticket.ticket]
        return flight.RecordBatchStream(pa.Table.from_batches(batches))

    def do_exchange(self, context: Any, descriptor: flight.FlightDescriptor, reader: Any,
                    writer: Any) -> None:
        """A session's floor: each metadata message is answered with one metadata message
        holding the first batch of the stored table the command names, serialized once."""
        with self._lock:
            batch = self._tables[descriptor.command][0]
        answer = pa.py_buffer(b'{"id": 1}\n' + batch.serialize().to_pybytes())
        writer.begin(pa.schema([]))
        for _ in reader:
            writer.write_metadata(answer)

    def do_action(self, context: Any, action: flight.Action) -> Iterator[flight.Result]:
        if action.type == "row":
            body = action.body.to_pybytes()
            pa.ipc.open_stream(body).read_all()  # what a real server must at least do
            yield flight.Result(pa.py_buffer(body))
        elif action.type == "ping":
            yield flight.Result(pa.py_buffer(b"{}"))
        else:
            raise flight.FlightServerError(f"unknown action {action.type!r}; expected row or ping")


def _serve(conn: Any) -> None:
    server = RawServer(f"grpc://{HOST}:0")
    conn.send(server.port)
    server.serve()


@contextlib.contextmanager
def raw_server() -> Iterator[str]:
    """Start the raw server in a spawned subprocess; yields its ``grpc://`` URI."""
    ctx = spawn_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("raw Flight server did not report its port within 60 s")
        port = parent.recv()
        wait_port(port, alive=proc.is_alive)
        yield f"grpc://{HOST}:{port}"
    finally:
        proc.terminate()
        proc.join(10)


def one_row_ipc(row: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, row.schema) as w:
        w.write_table(row)
    return sink.getvalue().to_pybytes()


def put_stream(client: flight.FlightClient, path: str, table: pa.Table) -> int:
    """One do_put stream of ``table``'s batches; acks are read by a second thread as they come
    (a client waiting for each ack before the next batch would measure round trips instead)."""
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(path), table.schema)
    acks = [0]

    def drain() -> None:
        while reader.read() is not None:
            acks[0] += 1

    t = threading.Thread(target=drain)
    t.start()
    for batch in table.to_batches():
        writer.write_batch(batch)
    writer.done_writing()
    t.join()
    writer.close()
    return acks[0]


def exchange_round_trips(client: flight.FlightClient, name: str, n: int) -> list[float]:
    """Seconds of ``n`` round trips on one open ``do_exchange``: a small request message, and
    an answer holding the serialized first batch of stored table ``name`` (what a session
    micro-batch must at least move: a request and the rows, on a stream already open)."""
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(name.encode()))
    writer.begin(pa.schema([]))
    request = pa.py_buffer(b'{"id": 1, "action": "claim"}')
    took = []
    for _ in range(n + n // 10):                 # the first tenth warms up, untimed
        t0 = time.perf_counter()
        writer.write_metadata(request)
        reader.read_chunk()
        took.append(time.perf_counter() - t0)
    writer.done_writing()
    writer.close()
    return took[n // 10:]


def action_op(uri: str) -> tuple[Any, Any]:
    """Load factory: one ``row`` action per op."""
    client = flight.FlightClient(uri)
    body = one_row_ipc(narrow_table(1, seed=7))
    action = flight.Action("row", body)

    def op() -> None:
        for _ in client.do_action(action):
            pass

    return op, client.close


def put_one_op(uri: str) -> tuple[Any, Any]:
    """Load factory: one do_put stream carrying one row, waiting for its ack, per op."""
    client = flight.FlightClient(uri)
    row = narrow_table(1, seed=7)
    desc = flight.FlightDescriptor.for_path("sink-one")

    def op() -> None:
        writer, reader = client.do_put(desc, row.schema)
        writer.write_table(row)
        writer.done_writing()
        reader.read()
        writer.close()

    return op, client.close


def run(ctx: Ctx) -> None:
    narrow = narrow_table(BATCH_ROWS)
    wide = wide_table(BATCH_ROWS)
    narrow_batches = ctx.pick(250, 1000)  # 1 M / 4 M rows per stream
    wide_batches = ctx.pick(2, 6)  # 100 / 300 MB per stream
    repeats = ctx.pick(3, 5)
    narrow_stream = pa.Table.from_batches(narrow.to_batches() * narrow_batches)
    wide_stream = pa.Table.from_batches(wide.to_batches() * wide_batches)
    with raw_server() as uri:
        client = flight.FlightClient(uri)
        put_stream(client, "sink-warm", narrow_stream)
        rate = median_rate(narrow_stream.num_rows,
                           lambda: put_stream(client, "sink-n", narrow_stream), repeats)
        ctx.record("narrow_rows_per_s", rate, "rows/s", "do_put narrow, 4,096-row batches")
        rate = median_rate(mb(wide_stream), lambda: put_stream(client, "sink-w", wide_stream),
                           repeats)
        ctx.record("wide_mb_per_s", rate, "MB/s", "do_put wide, 4,096-row batches")
        # The same bytes in 512-row (~6 MB) messages: gRPC assembles each message it receives in
        # one allocation, and one of ~50 MB is fresh memory every time (page faults).
        wide_small = rebatch(wide_stream, 512)
        rate = median_rate(mb(wide_small), lambda: put_stream(client, "sink-w", wide_small),
                           repeats)
        ctx.record("wide512_mb_per_s", rate, "MB/s", "do_put wide, 512-row batches")

        put_stream(client, "narrow", narrow_stream)
        ticket = flight.Ticket(b"narrow")
        rate = median_rate(narrow_stream.num_rows,
                           lambda: client.do_get(ticket).read_all(), repeats)
        ctx.record("get_narrow_rows_per_s", rate, "rows/s", "do_get narrow")

        for kind, table in (("narrow", narrow), ("wide", wide)):
            put_stream(client, f"mb16-{kind}", table.slice(0, 16))
            p50, _ = percentiles_ms(exchange_round_trips(client, f"mb16-{kind}",
                                                         ctx.pick(500, 2000)))
            ctx.record(f"exchange16_{kind}_p50_ms", p50, "ms",
                       f"one message each way on an open do_exchange, the answer 16 {kind} rows")

        call = action_op(uri)[0]
        p50, p99 = percentiles_ms(time_calls(call, ctx.pick(500, 2000)))
        ctx.record("call_p50_ms", p50, "ms", "one-row do_action round trip p50")
        ctx.record("call_p99_ms", p99, "ms", "one-row do_action round trip p99")
        put1 = put_one_op(uri)[0]
        p50, p99 = percentiles_ms(time_calls(put1, ctx.pick(300, 1000)))
        ctx.record("put1_p50_ms", p50, "ms", "one-row do_put + ack p50")
        ctx.record("put1_p99_ms", p99, "ms", "one-row do_put + ack p99")

        seconds = ctx.pick(1.5, 3.0)
        for factory, key, label in (
            ("bench.flight_raw:action_op", "calls64", "one-row do_action calls, 64 connections"),
            ("bench.flight_raw:put_one_op", "puts64", "one-row do_put streams, 64 connections"),
        ):
            res = run_load(factory, (uri,), connections=64, processes=2, seconds=seconds)
            ctx.record(f"{key}_per_s", res.rate, "calls/s", label)
            ctx.record(f"{key}_p99_ms", res.p99_ms, "ms", "  … p99 per call")
        client.close()
    ctx.series("meta", json.loads(json.dumps({"narrow_batches": narrow_batches,
                                              "wide_batches": wide_batches})))
