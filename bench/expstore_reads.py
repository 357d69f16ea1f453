"""expstore reading by-reference values back, each figure beside raw Flight ``do_get`` of the
same bytes in the same run; TransferQueue's workload and micro-batch flow through expstore.

* TransferQueue's throughput workload (bench/transferqueue.py: 1,024 rows × 10 fields of 1,024
  float32, 40 MiB), every field stored by reference: put in one call (GB/s), then read back
  by claims of 16 and of 64 (acked after the timed reads) and by ``SELECT *``;
* the wide rows (~12 KB, bench/workloads.py), every value column by reference, read the same
  ways;
* a micro-batch of 16, fetch and settle (the ack waited durable), narrow and wide, plain and in
  groups of 8 (TransferQueue's get_meta + get_data is its counterpart): a trainer's loop in
  which each claim carries the ack of the micro-batch before it (one request, answered once that
  ack is durable), and as two calls, ``claim`` then ``ack``.

"Raw Flight" is the trivial in-memory server of bench/flight_raw.py serving the very tables the
claims (or the query) returned, one ``do_get`` per claim: the same bytes in the same number of
calls, so each ratio isolates what the store adds. MB is 1e6 bytes of Arrow buffers
(``Table.nbytes``) of what the claim returned. The server's resident memory is recorded after
each read.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench import expstore_server
from bench.context import Ctx
from bench.expstore_claims import claim_latencies, fill
from bench.flight_raw import put_stream, raw_server
from bench.transferqueue import TQ_FIELDS, TQ_ROWS, TQ_WIDTH, tq_fields
from bench.util import percentiles_ms, run_for
from bench.workloads import GROUP, NARROW_COLUMNS, WIDE_COLUMNS, sample_ids, wide_table

NAME = "expstore_reads"
TITLE = "expstore reads of by-reference values vs raw Flight do_get of the same bytes"

TQ_COLUMNS = {f"field_{i}": "list<float32>" for i in range(TQ_FIELDS)}


def tq_table(start: int = 0) -> pa.Table:
    """TransferQueue's workload as an Arrow table (the values its benchmark puts)."""
    offsets = pa.array(np.arange(0, (TQ_ROWS + 1) * TQ_WIDTH, TQ_WIDTH, dtype=np.int32))
    columns: dict[str, Any] = {"sample_id": sample_ids(TQ_ROWS, start)}
    for name, values in tq_fields().items():
        columns[name] = pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))
    return pa.table(columns)


def read_by_claims(s: Any, table: str, size: int) -> tuple[list[float], list[pa.Table]]:
    """Claim ``size`` rows at a time until the table is empty: each claim's duration and what
    it returned (acked afterwards, so that only reads are timed)."""
    took: list[float] = []
    got: list[pa.Table] = []
    ids: list[str] = []
    while True:
        t0 = time.perf_counter()
        c = s.claim(table, size, consumer="bench-reads")
        t1 = time.perf_counter()
        if c.data.num_rows == 0:
            break
        took.append(t1 - t0)
        got.append(c.data)
        ids.append(c.claim_id)
    for future in [s.ack_async(i) for i in ids]:
        future.result(60)
    return took, got


def raw_gets(client: flight.FlightClient, tables: list[pa.Table], tag: str) -> float:
    """Seconds raw Flight takes to serve ``tables``, one do_get each (their bytes, their
    number of calls); each table is put once before."""
    for i, t in enumerate(tables):
        put_stream(client, f"{tag}-{i}", t)
    tickets = [flight.Ticket(f"{tag}-{i}".encode()) for i in range(len(tables))]
    client.do_get(tickets[0]).read_all()
    t0 = time.perf_counter()
    for ticket in tickets:
        client.do_get(ticket).read_all()
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _rss(ctx: Ctx, name: str, label: str) -> None:
    rss = expstore_server.rss_mb()
    if rss is not None:
        ctx.record(name, rss, "MB", label)


def _reads(ctx: Ctx, s: Any, raw: flight.FlightClient, shape: str, make: Any,
           columns: dict[str, str]) -> None:
    """Put three tables of ``shape`` (timed), read one by claims of 16, one by claims of 64,
    one by SQL; each beside raw Flight serving the same tables."""
    tables, puts = [], []
    for i in range(3):
        name = expstore_server.table_name(f"reads_{shape}")
        s.create_table(name, columns, storage={c: "ref" for c in columns})
        data = make(i * 10**6)
        t0 = time.perf_counter()
        s.put(name, data)
        puts.append(time.perf_counter() - t0)
        tables.append(name)
    nbytes = data.nbytes
    ctx.record(f"{shape}_put_mb_per_s", nbytes / _median(puts) / 1e6, "MB/s",
               f"{shape}: one put of {data.num_rows:,} rows, {nbytes / 2**20:.0f} MiB, median")
    raw_puts = []
    for _ in range(3):
        t0 = time.perf_counter()
        put_stream(raw, "sink-reads", data)          # the transport's bound for that put
        raw_puts.append(time.perf_counter() - t0)
    ctx.record(f"raw_{shape}_put_mb_per_s", nbytes / _median(raw_puts) / 1e6, "MB/s",
               "  raw Flight do_put of the same table, median")
    for size, table in ((16, tables[0]), (64, tables[1])):
        took, got = read_by_claims(s, table, size)
        mb = sum(t.nbytes for t in got) / 1e6
        ours = mb / sum(took)
        ctx.record(f"{shape}_claim{size}_mb_per_s", ours, "MB/s",
                   f"{shape}: read back by claims of {size}")
        _rss(ctx, f"{shape}_claim{size}_rss_mb", "  … server RSS after them")
        theirs = mb / raw_gets(raw, got, f"{shape}-{size}")
        ctx.record(f"raw_{shape}_claim{size}_mb_per_s", theirs, "MB/s",
                   f"  raw Flight do_get of the same {len(got)} tables")
    took, results = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        result = s.query(f'SELECT * FROM "{tables[2]}"')
        took.append(time.perf_counter() - t0)
        results.append(result)
    mb = result.nbytes / 1e6
    ctx.record(f"{shape}_sql_mb_per_s", mb / _median(took), "MB/s",
               f"{shape}: SELECT * of {result.num_rows:,} rows, median")
    _rss(ctx, f"{shape}_sql_rss_mb", "  … server RSS after it")
    raw_s = [raw_gets(raw, [result], f"{shape}-sql-{i}") for i in range(3)]
    ctx.record(f"raw_{shape}_sql_mb_per_s", mb / _median(raw_s), "MB/s",
               "  raw Flight do_get of the same result, median")
    for name in tables:
        s.drop_table(name)


def carried_acks(s: Any, table: str, n: int, size: int, group: bool,
                 budget_s: float) -> list[float]:
    """Durations (s) of a trainer's micro-batch loop in which each claim carries the ack of the
    micro-batch before it (``claim(…, ack=…)``): one request fetches a micro-batch and settles
    the one before, answered once that ack is durable; the last ack is sent alone."""
    kw: dict[str, Any] = {"group_by": "input_id", "group_size": GROUP} if group else {}
    held: list[str | None] = [None]

    def step() -> None:
        c = s.claim(table, size, consumer="bench-mb", ack=held[0], **kw)
        if c.data.num_rows != size:
            raise RuntimeError(f"claim of {size} returned {c.data.num_rows} rows; table too small?")
        held[0] = c.claim_id

    took = run_for(step, budget_s, n, warmup=5)
    if held[0] is not None:
        s.ack(held[0])
    return took


def _micro_batches(ctx: Ctx, s: Any) -> None:
    """A micro-batch of 16 fetched and settled (the ack waited durable) p50, narrow and wide,
    plain and grouped: each claim carrying the ack of the micro-batch before it, and as two
    calls (claim, then a waited ack)."""
    n = ctx.pick(100, 300)
    budget = ctx.pick(1.5, 3.0)
    for kind in ("narrow", "wide"):
        for group in (False, True):
            table = expstore_server.table_name(f"mb_{kind}")
            rows = 16 * (3 * n + 45)
            if kind == "narrow":
                s.create_table(table, dict(NARROW_COLUMNS))
                fill(s, table, rows)
            else:
                s.create_table(table, dict(WIDE_COLUMNS))
                for i in range(0, rows, 1024):
                    s.put(table, wide_table(min(1024, rows - i), start=i))
            pairs = claim_latencies(s, table, n, 16, group, budget)[1]
            carried = carried_acks(s, table, n, 16, group, budget)
            tag = f"mb16_{kind}" + ("_group" if group else "")
            what = f"micro-batch of 16 {kind}" + (", groups of 8" if group else "")
            p50, p99 = percentiles_ms(carried)
            ctx.record(f"{tag}_p50_ms", p50, "ms",
                       f"{what}: claim carrying the last ack (durable) p50")
            ctx.record(f"{tag}_p99_ms", p99, "ms", "  … p99")
            p50, p99 = percentiles_ms(pairs)
            ctx.record(f"{tag}_two_calls_p50_ms", p50, "ms", "  … as claim, then waited ack, p50")
            ctx.record(f"{tag}_two_calls_p99_ms", p99, "ms", "  … p99")
            s.drop_table(table)


def run(ctx: Ctx) -> None:
    import store

    uri = expstore_server.uri(ctx)
    s = store.connect(uri)
    _rss(ctx, "start_rss_mb", "server RSS before the reads")
    with raw_server() as raw_uri:
        raw = flight.FlightClient(raw_uri)
        _reads(ctx, s, raw, "tq", tq_table, TQ_COLUMNS)
        wide_rows = ctx.pick(512, 1024)
        _reads(ctx, s, raw, "wide", lambda start: wide_table(wide_rows, start=start),
               dict(WIDE_COLUMNS))
        raw.close()
    _micro_batches(ctx, s)
    s.close()
