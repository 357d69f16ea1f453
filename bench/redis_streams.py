"""Baseline: Redis Streams through redis-py, the hand-made experience buffer.

Ingest is ``XADD`` of one entry per row, pipelined 4,096 (narrow) or 256 (wide) at a time; a
claim is ``XREADGROUP COUNT 16`` followed by ``XACK`` of the returned ids. The bench starts its
own ``redis-server`` on a free loopback port with persistence off and its working directory in a
temporary folder (nothing is left behind). That makes the baseline generous: nothing Redis
acknowledges here is durable, while expstore acknowledges a write only once it is.
Rows are converted to Python dicts before the clock starts.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.context import Ctx, Skip
from bench.util import HOST, free_port, percentiles_ms, time_calls, wait_port
from bench.workloads import mb, narrow_table, wide_table

NAME = "redis_streams"
TITLE = "Redis Streams via redis-py (no persistence)"


@contextlib.contextmanager
def redis_server() -> Iterator[Any]:
    """A private ``redis-server`` on a free loopback port; yields a connected client."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise Skip("redis-server not installed (apt-get install -y redis-server)")
    try:
        import redis
    except ImportError as e:
        raise Skip("redis-py not installed (pip install redis)") from e
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        port = free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", tmp, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port, alive=lambda: proc.poll() is None)
            client = redis.Redis(host=HOST, port=port)
            deadline = time.monotonic() + 30
            while True:  # the port opens a moment before Redis answers
                try:
                    client.ping()
                    break
                except redis.exceptions.BusyLoadingError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            yield client
            client.close()
        finally:
            proc.terminate()
            proc.wait(10)


def _xadd(client: Any, stream: str, rows: list[dict], chunk: int) -> None:
    for i in range(0, len(rows), chunk):
        pipe = client.pipeline(transaction=False)
        for row in rows[i:i + chunk]:
            pipe.xadd(stream, row)
        pipe.execute()


def _narrow_rows(n: int) -> list[dict]:
    rows = narrow_table(n).to_pylist()
    for r in rows:
        for k in ("done", "truncated", "correct"):
            r[k] = int(r[k])
    return rows


def _wide_rows(n: int) -> tuple[list[dict], float]:
    """Wide rows as Redis entries (lists as raw little-endian bytes) and their Arrow MB."""
    t = wide_table(n)
    tok = t.column("token_ids").combine_chunks().values.to_numpy().reshape(n, -1)
    lp = t.column("logprobs").combine_chunks().values.to_numpy().reshape(n, -1)
    ids, prompts, responses = (t.column(c).to_pylist() for c in ("sample_id", "prompt", "response"))
    return [{"sample_id": ids[i], "prompt": prompts[i], "response": responses[i],
             "token_ids": np.ascontiguousarray(tok[i]).tobytes(),
             "logprobs": np.ascontiguousarray(lp[i]).tobytes()} for i in range(n)], mb(t)


def run(ctx: Ctx) -> None:
    n_narrow = ctx.pick(50_000, 200_000)
    n_wide = ctx.pick(1024, 4096)
    narrow_rows = _narrow_rows(n_narrow)
    wide_rows, wide_mb = _wide_rows(n_wide)
    with redis_server() as r:
        t0 = time.perf_counter()
        _xadd(r, "narrow", narrow_rows, 4096)
        secs = time.perf_counter() - t0
        ctx.record("narrow_rows_per_s", n_narrow / secs, "rows/s",
                   "XADD narrow, pipelined 4,096")
        t0 = time.perf_counter()
        _xadd(r, "wide", wide_rows, 256)
        secs = time.perf_counter() - t0
        ctx.record("wide_mb_per_s", wide_mb / secs, "MB/s",
                   "XADD wide, pipelined 256")
        del wide_rows
        r.delete("wide")

        r.xgroup_create("narrow", "trainers", id="0")

        def claim_ack() -> None:
            resp = r.xreadgroup("trainers", "c0", {"narrow": ">"}, count=16)
            ids = [entry_id for entry_id, _ in resp[0][1]]
            r.xack("narrow", "trainers", *ids)

        n_claims = ctx.pick(500, 2000)
        p50, p99 = percentiles_ms(time_calls(claim_ack, n_claims))
        ctx.record("claim16_ack_p50_ms", p50, "ms", "XREADGROUP 16 + XACK p50")
        ctx.record("claim16_ack_p99_ms", p99, "ms", "XREADGROUP 16 + XACK p99")

        def claim() -> None:
            r.xreadgroup("trainers", "c1", {"narrow": ">"}, count=16, noack=True)

        p50, p99 = percentiles_ms(time_calls(claim, n_claims))
        ctx.record("claim16_p50_ms", p50, "ms", "XREADGROUP 16 alone p50")
