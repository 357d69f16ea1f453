"""Baseline: ``ray.util.queue.Queue`` (an actor-backed queue) on a local Ray started on 127.0.0.1.

Rows are queue items (dicts; wide rows carry numpy arrays), put with ``put_nowait_batch`` in
chunks and taken with ``get_nowait_batch`` — the fastest way the queue offers to move samples.
One-item ``put`` calls and whole Arrow batches as items are reported beside them, for scale.
Ray's own start-up (several seconds) is not timed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from bench.context import Ctx, Skip
from bench.util import percentiles_ms, time_calls
from bench.workloads import BATCH_ROWS, mb, narrow_table, wide_table

NAME = "ray_queue"
TITLE = "Ray queue (ray.util.queue.Queue, local cluster)"


def loopback_env() -> None:
    """Ray 2.60 silently replaces ``_node_ip_address="127.0.0.1"`` with the machine's external
    address unless this variable is set before ``ray`` is first imported (by anything)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@contextlib.contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[Any]:
    """A local Ray bound to 127.0.0.1 (asserted), shut down afterwards; Skip where it cannot
    start. ``num_cpus``: what Ray may hand out (TransferQueue's actors each reserve one)."""
    loopback_env()
    try:
        import ray
    except ImportError as e:
        raise Skip("ray not installed (pip install 'ray[default]')") from e
    # a short temp dir: Ray puts unix sockets under it, and their paths have a length limit
    tmp = tempfile.mkdtemp(prefix="br-", dir="/tmp")
    try:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus,
                 log_to_driver=False, _temp_dir=tmp, configure_logging=False)
    except Exception as e:  # noqa: BLE001 - any start-up failure means: no Ray baseline here
        shutil.rmtree(tmp, ignore_errors=True)
        raise Skip(f"ray.init failed: {type(e).__name__}: {e}") from e
    try:
        addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
        if addresses != {"127.0.0.1"}:
            raise RuntimeError(f"Ray bound {sorted(addresses)}, not only 127.0.0.1")
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _put_get(queue: Any, rows: list, chunk: int) -> tuple[float, float]:
    """Seconds to put all ``rows`` in chunks, then to get them all back."""
    t0 = time.perf_counter()
    for i in range(0, len(rows), chunk):
        queue.put_nowait_batch(rows[i:i + chunk])
    t1 = time.perf_counter()
    got = 0
    while got < len(rows):
        got += len(queue.get_nowait_batch(min(chunk, len(rows) - got)))
    return t1 - t0, time.perf_counter() - t1


def run(ctx: Ctx) -> None:
    narrow = narrow_table(ctx.pick(50_000, 200_000))
    rows = narrow.to_pylist()
    n_wide = ctx.pick(512, 2048)
    wide = wide_table(n_wide)
    wide_rows = [{"sample_id": r["sample_id"], "prompt": r["prompt"], "response": r["response"],
                  "token_ids": wide.column("token_ids")[i].values.to_numpy(),
                  "logprobs": wide.column("logprobs")[i].values.to_numpy()}
                 for i, r in enumerate(wide.select(["sample_id", "prompt", "response"])
                                       .to_pylist())]
    with local_ray():
        from ray.util.queue import Queue

        q = Queue()
        single = iter(rows)
        lat = time_calls(lambda: q.put(next(single)), ctx.pick(200, 1000), warmup=20)
        ctx.record("put1_per_s", len(lat) / sum(lat), "rows/s", "put() one row per call")
        ctx.record("put1_p50_ms", percentiles_ms(lat)[0], "ms", "put() one row p50")
        q.shutdown()

        q = Queue()
        put_s, get_s = _put_get(q, rows, BATCH_ROWS)
        ctx.record("narrow_rows_per_s", len(rows) / put_s, "rows/s",
                   "put_nowait_batch narrow, 4,096 rows per call")
        ctx.record("narrow_get_rows_per_s", len(rows) / get_s, "rows/s",
                   "get_nowait_batch narrow, 4,096 rows per call")
        put_s, get_s = _put_get(q, wide_rows, 256)
        ctx.record("wide_mb_per_s", mb(wide) / put_s, "MB/s", "put_nowait_batch wide, 256 rows")
        ctx.record("wide_get_mb_per_s", mb(wide) / get_s, "MB/s", "get_nowait_batch wide")
        batches = narrow.to_batches(max_chunksize=BATCH_ROWS)
        put_s, get_s = _put_get(q, batches, 16)
        ctx.record("arrow_items_rows_per_s", narrow.num_rows / put_s, "rows/s",
                   "Arrow 4,096-row batches as items (put)")
        q.shutdown()
