"""expstore claims: claim 16/64 latency, plain and group-aware, from 1 and 8 consumers;
and put→delivered latency through a micro-batch subscription.

Claim latency is the ``claim()`` call alone, claims back to back as the raw Flight call it is
compared with is measured (they are acked afterwards); a claim right after a waited ack is
recorded too (``…_after_ack``: slower, the machine idled through the ack's commit). "claim+ack"
adds the ``ack()`` round trip (what Redis' XREADGROUP + XACK pair does), waiting until the ack is
durable; "pipelined" sends the ack with ``ack_async()`` and claims the next micro-batch at once,
as a trainer does (each ack is still checked durable before the figure counts). Groups are the 8
trajectories of one ``input_id``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench import expstore_server
from bench.context import Ctx
from bench.load import run_load
from bench.util import percentiles_ms, run_for
from bench.workloads import GROUP, NARROW_COLUMNS, narrow_table, rebatch

NAME = "expstore_claims"
TITLE = "expstore claims and subscription latency"


def fill(s: Any, table: str, rows: int, start: int = 0, chunk: int = 1_000_000) -> None:
    for i in range(start, start + rows, chunk):
        s.put(table, rebatch(narrow_table(min(chunk, start + rows - i), start=i)))


def claim_latencies(s: Any, table: str, n: int, size: int, group: bool,
                    budget_s: float, where: str | None = None) -> tuple[list, list, list]:
    """Durations (s) of up to ``n`` claims each (within ``budget_s``): claims back to back (as
    the raw Flight call they are compared with is measured; acked afterwards), claim+ack pairs,
    and the claims of those pairs (each right after a waited ack); ``where``: a predicate."""
    kw: dict[str, Any] = {"group_by": "input_id", "group_size": GROUP} if group else {}
    if where is not None:
        kw["where"] = where
    held: list[str] = []

    def claim() -> Any:
        c = s.claim(table, size, consumer="bench-0", **kw)
        if c.data.num_rows != size:
            raise RuntimeError(f"claim of {size} returned {c.data.num_rows} rows; table too small?")
        return c

    claims = run_for(lambda: held.append(claim().claim_id), budget_s, n, warmup=5)
    for future in [s.ack_async(claim_id) for claim_id in held]:
        future.result(60)
    after_ack: list[float] = []

    def claim_ack() -> None:
        t0 = time.perf_counter()
        c = claim()
        after_ack.append(time.perf_counter() - t0)
        s.ack(c.claim_id)

    pairs = run_for(claim_ack, budget_s, n, warmup=5)
    return claims, pairs, after_ack[5:]


def claim_ack_pipelined(s: Any, table: str, n: int, size: int, group: bool,
                        budget_s: float) -> list[float]:
    """Durations (s) of claim + ``ack_async`` pairs: a trainer's loop that acks a micro-batch and
    claims the next without waiting for the ack's commit. Every ack must then turn out durable
    (its Future is checked before returning), so nothing is measured that did not happen."""
    kw = {"group_by": "input_id", "group_size": GROUP} if group else {}
    acks: list[Any] = []

    def claim_ack() -> None:
        c = s.claim(table, size, consumer="bench-0", **kw)
        if c.data.num_rows != size:
            raise RuntimeError(f"claim of {size} returned {c.data.num_rows} rows; table too small?")
        acks.append(s.ack_async(c.claim_id))

    pairs = run_for(claim_ack, budget_s, n, warmup=5)
    for future in acks:
        if future.result(60)["acked"] != size:
            raise RuntimeError(f"a pipelined ack answered {future.result()}")
    return pairs


def claim_op(uri: str, table: str, size: int, group: bool) -> tuple[Any, Any]:
    """Load factory: claim ``size`` rows and ack them, per op."""
    import store

    s = store.connect(uri)
    kw = {"group_by": "input_id", "group_size": GROUP} if group else {}
    name = f"bench-{threading.get_ident()}"

    def op() -> None:
        c = s.claim(table, size, consumer=name, **kw)
        if c.data.num_rows == 0:
            raise RuntimeError("empty claim")
        s.ack(c.claim_id)

    return op, s.close


def put_to_delivery(s_put: Any, s_sub: Any, table: str, n: int, budget_s: float,
                    start: int = 5 * 10**8) -> list[float]:
    """Durations (s) from the start of a one-sample ``put()`` to its micro-batch arriving
    (samples numbered from ``start``: each call on a table needs fresh ones)."""
    delivered = threading.Semaphore(0)
    stop = threading.Event()
    stamps: list[float] = []
    errors: list[BaseException] = []
    sub = s_sub.subscribe(table, micro_batch_size=1, global_batch_size=1 << 30)

    def consume() -> None:
        try:
            while not stop.is_set():
                mb = sub.next(timeout=0.5)  # a timeout, so that ``stop`` is seen
                if mb is None:
                    continue
                stamps.append(time.perf_counter())
                mb.ack()
                delivered.release()
        except BaseException as e:  # noqa: BLE001 - reported by the producer side
            errors.append(e)
            delivered.release()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    rows = narrow_table(n, start=start)
    out: list[float] = []
    end = time.perf_counter() + budget_s
    for i in range(n):
        if len(out) >= 20 and time.perf_counter() > end:
            break
        t0 = time.perf_counter()
        s_put.put(table, rows.slice(i, 1))
        if not delivered.acquire(timeout=30):
            raise RuntimeError(f"sample {i} was not delivered within 30 s")
        if errors:
            raise errors[0]
        out.append(stamps[-1] - t0)
    stop.set()
    t.join(10)
    if hasattr(sub, "close"):
        sub.close()
    return out


def run(ctx: Ctx) -> None:
    import store

    uri = expstore_server.uri(ctx)
    s = store.connect(uri)
    n = ctx.pick(300, 1000)
    seconds = ctx.pick(1.5, 3.0)
    budget = ctx.pick(1.5, 3.0)
    for group in (False, True):
        kind = "group" if group else "plain"
        table = expstore_server.table_name(f"claims_{kind}")
        s.create_table(table, dict(NARROW_COLUMNS), if_not_exists=True)
        # back-to-back claims, claim+ack pairs and pipelined pairs of 16 and 64 rows, up to
        # 1,000 each: ~200 k rows in the full run
        fill(s, table, ctx.pick(80_000, 250_000))
        for size in (16, 64):
            claims, pairs, after_ack = claim_latencies(s, table, n, size, group, budget)
            p50, p99 = percentiles_ms(claims)
            tag = f"claim{size}" + ("_group" if group else "")
            ctx.record(f"{tag}_p50_ms", p50, "ms", f"{kind} claim {size} p50, 1 consumer")
            ctx.record(f"{tag}_p99_ms", p99, "ms", f"{kind} claim {size} p99, 1 consumer")
            p50, p99 = percentiles_ms(after_ack)
            ctx.record(f"{tag}_after_ack_p50_ms", p50, "ms",
                       "  … p50 of a claim right after a waited ack")
            p50, p99 = percentiles_ms(pairs)
            ctx.record(f"{tag}_ack_p50_ms", p50, "ms", f"{kind} claim {size} + ack p50")
            ctx.record(f"{tag}_ack_p99_ms", p99, "ms", f"{kind} claim {size} + ack p99")
            p50, p99 = percentiles_ms(claim_ack_pipelined(s, table, n, size, group, budget))
            ctx.record(f"{tag}_ackpipe_p50_ms", p50, "ms",
                       f"{kind} claim {size} + pipelined ack (ack_async) p50")
            ctx.record(f"{tag}_ackpipe_p99_ms", p99, "ms",
                       f"{kind} claim {size} + pipelined ack (ack_async) p99")
        # A table of its own: the single-consumer runs above may take nearly all of theirs
        # (an empty claim counts as an error, not as a claim).
        table = expstore_server.table_name(f"claims_{kind}_8c")
        s.create_table(table, dict(NARROW_COLUMNS), if_not_exists=True)
        fill(s, table, ctx.pick(40_000, 160_000))
        res = run_load("bench.expstore_claims:claim_op", (uri, table, 16, group), connections=8,
                       processes=2, seconds=seconds)
        tag = "claim16" + ("_group" if group else "")
        ctx.record(f"{tag}_8c_per_s", res.rate, "claims/s", f"{kind} claim 16 + ack, 8 consumers")
        if res.ops:
            ctx.record(f"{tag}_8c_p50_ms", res.p50_ms, "ms", "  … p50")
            ctx.record(f"{tag}_8c_p99_ms", res.p99_ms, "ms", "  … p99")
        if res.errors:
            ctx.record(f"{tag}_8c_errors", res.errors, "errors",
                       f"  … failed claims ({res.first_error})")

    table = expstore_server.table_name("deliver")
    s.create_table(table, dict(NARROW_COLUMNS), if_not_exists=True)
    consumer = store.connect(uri)
    try:
        lat = put_to_delivery(s, consumer, table, ctx.pick(200, 1000), budget)
    finally:
        consumer.close()
    p50, p99 = percentiles_ms(lat)
    ctx.record("deliver_p50_ms", p50, "ms", "put → delivered via subscription p50")
    ctx.record("deliver_p99_ms", p99, "ms", "put → delivered via subscription p99")
    s.close()
