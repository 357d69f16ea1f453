"""expstore reading by-reference values back, each figure beside raw Flight ``do_get`` of the
same bytes in the same run; TransferQueue's workload and micro-batch flow through expstore.

* TransferQueue's throughput workload (bench/transferqueue.py: 1,024 rows × 10 fields of 1,024
  float32, 40 MiB), every field stored by reference: put in one call (GB/s), then read back
  by claims of 16 and of 64 (acked after the timed reads) and by ``SELECT *``;
* the wide rows (~12 KB, bench/workloads.py), every value column by reference, read the same
  ways; and as rollouts write them (several puts of whole groups, input ids as UUIDs), read by
  claims of 64, each of which then takes its groups from several puts;
* a micro-batch of 16, fetch and settle (the ack waited durable), narrow and wide, plain and in
  groups of 8 (TransferQueue's get_meta + get_data is its counterpart): a trainer's loop in
  which each claim carries the ack of the micro-batch before it (one request, answered once that
  ack is durable), as two calls, ``claim`` then ``ack``, and through a subscription (each
  micro-batch pushed ahead, ``next`` then a waited ``ack``: the trainer's consumer).

"Raw Flight" is the trivial in-memory server of bench/flight_raw.py serving the very tables the
claims (or the query) returned, one ``do_get`` per claim, paired call by call with the claims
so that the load of a shared machine lands on both alike: the same bytes in the same number of
calls; each ratio isolates what the store adds. A claim's table is served for the first time
4 claims after it was put (``raw_…``, the targets' baseline: a claim too serves rows stored
earlier, for the first time), and again warm (``raw_warm_…``: a second serve right after the
first); a query's result is served warm. MB is 1e6 bytes of Arrow buffers (``Table.nbytes``)
of what the claim returned. The server's resident memory is recorded after each read.
"""

from __future__ import annotations

import collections
import time
import uuid
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


#: Claims between a table's put to raw Flight and its timed first serve (:func:`read_by_claims`).
RAW_LAG = 4


def read_by_claims(s: Any, table: str, size: int, raw: flight.FlightClient, tag: str
                   ) -> tuple[list[float], list[float], list[float], list[pa.Table]]:
    """Claim ``size`` rows at a time until the table is empty, each claim followed by raw
    Flight serving the very tables claims returned: the claims' durations, raw Flight's first
    serves, its warm serves, and what the claims returned (acked afterwards, so that only reads
    are timed). Paired call by call, so that the load of a shared machine lands on both alike.

    Raw Flight serves each table for the first time :data:`RAW_LAG` claims after it was put
    (as a claim serves rows stored earlier, for the first time: the targets' baseline); once
    every claim is made, it serves each again, warm (right after serving it once more,
    untimed), not paired: more calls between the claims made them slower. First serves ran at
    0.83-0.98x the warm ones' MB/s on a quiet machine (tables of 16 and 64 rows, 4 alternated
    rounds, 2026-11-27), 0.63-1.0x in a full benchmark run (BENCHMARKS.md)."""
    took: list[float] = []
    first: list[float] = []
    got: list[pa.Table] = []
    ids: list[str] = []
    waiting: collections.deque[str] = collections.deque()   # put to raw Flight, not served

    def serve_first(name: str) -> None:
        t0 = time.perf_counter()
        raw.do_get(flight.Ticket(name.encode())).read_all()
        first.append(time.perf_counter() - t0)

    while True:
        t0 = time.perf_counter()
        c = s.claim(table, size, consumer="bench-reads")
        t1 = time.perf_counter()
        if c.data.num_rows == 0:
            break
        took.append(t1 - t0)
        got.append(c.data)
        ids.append(c.claim_id)
        name = f"{tag}-{len(got)}"
        put_stream(raw, name, c.data)
        waiting.append(name)
        if len(waiting) > RAW_LAG:
            serve_first(waiting.popleft())
    while waiting:
        serve_first(waiting.popleft())
    warm = [warm_serve(raw, f"{tag}-{i + 1}") for i in range(len(got))]
    for future in [s.ack_async(i) for i in ids]:
        future.result(60)
    return took, first, warm, got


def raw_get(client: flight.FlightClient, table: pa.Table, name: str) -> float:
    """Seconds raw Flight takes to serve ``table`` in one do_get, warm (:func:`warm_serve`)."""
    put_stream(client, name, table)
    return warm_serve(client, name)


def warm_serve(client: flight.FlightClient, name: str) -> float:
    """Seconds raw Flight takes to serve the table it holds as ``name``, right after serving
    it once, untimed."""
    ticket = flight.Ticket(name.encode())
    client.do_get(ticket).read_all()
    t0 = time.perf_counter()
    client.do_get(ticket).read_all()
    return time.perf_counter() - t0


def rollout_puts(n: int, puts: int) -> list[pa.Table]:
    """``n`` wide rows as rollouts write them: ``puts`` puts of whole groups, input ids as UUID
    hex. A trainer claims in input-id order, so a claim's groups come from several puts, in an
    order unrelated to the puts' (where the other reads claim one put's rows in put order)."""
    data = wide_table(n, start=7 * 10**6)
    ids = [uuid.uuid5(uuid.NAMESPACE_OID, f"bench-{g}").hex for g in range(n // GROUP + 1)]
    data = data.set_column(0, "sample_id",
                           pa.array([f"{ids[i // GROUP]}_0_{i % GROUP}" for i in range(n)]))
    per = n // puts
    return [data.slice(k * per, per) for k in range(puts)]


def _rollout_reads(ctx: Ctx, s: Any, raw: flight.FlightClient, rows: int) -> None:
    """Wide rows put as rollouts write them (:func:`rollout_puts`), read back by claims of 64,
    beside raw Flight serving the same tables."""
    name = expstore_server.table_name("reads_rollouts")
    columns = dict(WIDE_COLUMNS)
    s.create_table(name, columns, storage={c: "ref" for c in columns})
    for part in rollout_puts(rows, 8):
        s.put(name, part)
    took, first, warm, got = read_by_claims(s, name, 64, raw, "rollouts-64")
    mb = sum(t.nbytes for t in got) / 1e6
    ctx.record("wide_rollouts_claim64_mb_per_s", mb / sum(took), "MB/s",
               "wide rows in 8 puts, input ids as UUIDs: read back by claims of 64")
    _raw_serves(ctx, "wide_rollouts_claim64", mb, first, warm, len(got))
    s.drop_table(name)


def _raw_serves(ctx: Ctx, key: str, mb: float, first: list[float], warm: list[float],
                n: int) -> None:
    ctx.record(f"raw_{key}_mb_per_s", mb / sum(first), "MB/s",
               f"  raw Flight do_get of the same {n} tables, each served once, "
               f"{RAW_LAG} claims after its put")
    ctx.record(f"raw_warm_{key}_mb_per_s", mb / sum(warm), "MB/s",
               "  … each served again, warm (right after an untimed serve)")


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
    tables, puts, raw_puts = [], [], []
    for i in range(3):                 # each put beside raw Flight's do_put of the same table
        name = expstore_server.table_name(f"reads_{shape}")
        s.create_table(name, columns, storage={c: "ref" for c in columns})
        data = make(i * 10**6)
        t0 = time.perf_counter()
        s.put(name, data)
        puts.append(time.perf_counter() - t0)
        tables.append(name)
        t0 = time.perf_counter()
        put_stream(raw, "sink-reads", data)          # the transport's bound for that put
        raw_puts.append(time.perf_counter() - t0)
    nbytes = data.nbytes
    ctx.record(f"{shape}_put_mb_per_s", nbytes / _median(puts) / 1e6, "MB/s",
               f"{shape}: one put of {data.num_rows:,} rows, {nbytes / 2**20:.0f} MiB, median")
    ctx.record(f"raw_{shape}_put_mb_per_s", nbytes / _median(raw_puts) / 1e6, "MB/s",
               "  raw Flight do_put of the same table, median")
    for size, table in ((16, tables[0]), (64, tables[1])):
        took, first, warm, got = read_by_claims(s, table, size, raw, f"{shape}-{size}")
        mb = sum(t.nbytes for t in got) / 1e6
        ctx.record(f"{shape}_claim{size}_mb_per_s", mb / sum(took), "MB/s",
                   f"{shape}: read back by claims of {size}")
        _rss(ctx, f"{shape}_claim{size}_rss_mb", "  … server RSS after them")
        _raw_serves(ctx, f"{shape}_claim{size}", mb, first, warm, len(got))
    took, raw_s = [], []
    for i in range(3):                 # each query beside raw Flight serving its result
        t0 = time.perf_counter()
        result = s.query(f'SELECT * FROM "{tables[2]}"')
        took.append(time.perf_counter() - t0)
        raw_s.append(raw_get(raw, result, f"{shape}-sql-{i}"))
    mb = result.nbytes / 1e6
    ctx.record(f"{shape}_sql_mb_per_s", mb / _median(took), "MB/s",
               f"{shape}: SELECT * of {result.num_rows:,} rows, median")
    _rss(ctx, f"{shape}_sql_rss_mb", "  … server RSS after it")
    ctx.record(f"raw_{shape}_sql_mb_per_s", mb / _median(raw_s), "MB/s",
               "  raw Flight do_get of the same result, each after its query, median")
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


def subscription_micro_batches(s: Any, table: str, n: int, size: int, group: bool,
                               budget_s: float) -> list[float]:
    """Durations (s) of a trainer's loop over a subscription, the consumer the README gives
    trainers: ``next()`` (a micro-batch the server pushed ahead, up to its default
    ``max_in_flight`` of 2), then ``ack()`` waited durable."""
    kw: dict[str, Any] = {"group_by": "input_id", "group_size": GROUP} if group else {}
    # one global batch for the whole loop: no boundary (and so no bump) in it
    sub = s.subscribe(table, micro_batch_size=size, global_batch_size=size * (n + 16),
                      consumer="bench-sub", **kw)

    def step() -> None:
        mb = sub.next(timeout=30)
        if mb is None or mb.data.num_rows != size:
            raise RuntimeError(f"subscription gave {mb and mb.data.num_rows} rows, not {size}; "
                               "table too small?")
        mb.ack()

    try:
        return run_for(step, budget_s, n, warmup=5)
    finally:
        sub.close()


def micro_batch_table(s: Any, table: str, kind: str, rows: int) -> None:
    """Create ``table`` with ``rows`` ready rows, ``kind`` "narrow" or "wide" (the micro-batch
    benchmarks' tables; scripts/ab_microbatch.py makes the same)."""
    if kind == "narrow":
        s.create_table(table, dict(NARROW_COLUMNS))
        fill(s, table, rows)
    else:
        s.create_table(table, dict(WIDE_COLUMNS))
        for i in range(0, rows, 1024):
            s.put(table, wide_table(min(1024, rows - i), start=i))


def _micro_batches(ctx: Ctx, s: Any) -> None:
    """A micro-batch of 16 fetched and settled (the ack waited durable) p50, narrow and wide,
    plain and grouped: each claim carrying the ack of the micro-batch before it, and as two
    calls (claim, then a waited ack)."""
    n = ctx.pick(100, 300)
    budget = ctx.pick(1.5, 3.0)
    for kind in ("narrow", "wide"):
        for group in (False, True):
            table = expstore_server.table_name(f"mb_{kind}")
            micro_batch_table(s, table, kind, 16 * (4 * n + 70))
            pairs = claim_latencies(s, table, n, 16, group, budget)[1]
            carried = carried_acks(s, table, n, 16, group, budget)
            pushed = subscription_micro_batches(s, table, n, 16, group, budget)
            tag = f"mb16_{kind}" + ("_group" if group else "")
            what = f"micro-batch of 16 {kind}" + (", groups of 8" if group else "")
            for suffix, took, label in (
                    ("", carried, f"{what}: claim carrying the last ack (durable)"),
                    ("_two_calls", pairs, "  … as claim, then waited ack,"),
                    ("_subscription", pushed,
                     "  … through a subscription (pushed ahead): next, then waited ack,")):
                p50, p99 = percentiles_ms(took)
                ctx.record(f"{tag}{suffix}_p50_ms", p50, "ms", f"{label} p50")
                ctx.record(f"{tag}{suffix}_p99_ms", p99, "ms", "  … p99")
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
        _rollout_reads(ctx, s, raw, wide_rows)
        raw.close()
    _micro_batches(ctx, s)
    s.close()
