"""Many concurrent connections doing one small operation in a loop, spread over processes.

64 Python threads in one process would measure the GIL, not the server; 64 processes would
thrash 2 cores. So ``connections`` are spread over ``processes`` spawned workers, each running
``connections / processes`` threads with their own client.

An operation is named by a factory ``"module:function"``; ``function(*args)`` is called once per
thread and returns ``(op, close)``: ``op()`` does one operation, ``close()`` releases the client.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
from typing import Any

from bench.util import percentiles_ms, spawn_context


@dataclasses.dataclass
class LoadResult:
    ops: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    first_error: str | None = None

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


def _factory(name: str) -> Any:
    module, func = name.split(":")
    return getattr(importlib.import_module(module), func)


def _thread(factory: str, args: tuple, ready: Any, start: Any, window: Any, out: list) -> None:
    try:
        op, close = _factory(factory)(*args)
    except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it
        ready.put(f"{factory}{args!r}: {type(e).__name__}: {e}")
        out.append((0, 1, [], None))
        return
    ready.put(None)
    ops = errors = 0
    first_error = None
    lat: list[float] = []
    try:
        start.wait()
        begin, end = window[0], window[1]
        clock = time.time
        while True:
            t0 = clock()
            if t0 >= end:
                break
            try:
                op()
            except Exception as e:  # noqa: BLE001 - counted and reported; the load keeps going
                errors += 1
                first_error = first_error or f"{type(e).__name__}: {e}"
                continue
            t1 = clock()
            if t0 >= begin:  # ops started in the warm-up are not counted
                ops += 1
                if len(lat) < 20_000:
                    lat.append(t1 - t0)
    finally:
        close()
    out.append((ops, errors, lat, first_error))


def _worker(factory: str, args: tuple, threads: int, ready: Any, start: Any, window: Any,
            results: Any) -> None:
    out: list = []
    ts = [threading.Thread(target=_thread, args=(factory, args, ready, start, window, out))
          for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    results.put(out)


def run_load(factory: str, args: tuple, connections: int = 64, processes: int = 4,
             seconds: float = 3.0, warmup: float = 0.5) -> LoadResult:
    """Run ``connections`` concurrent loops of the operation for ``seconds`` after a warm-up."""
    ctx = spawn_context()
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    window = ctx.Array("d", 2)
    per = [connections // processes + (1 if i < connections % processes else 0)
           for i in range(processes)]
    procs = [ctx.Process(target=_worker, args=(factory, args, n, ready, start, window, results),
                         daemon=True) for n in per if n]
    for p in procs:
        p.start()
    failures = [m for m in (ready.get(timeout=120) for _ in range(connections)) if m]
    # every thread has its client (or failed to get one): timing starts now
    now = time.time()
    if failures:
        window[0] = window[1] = now
        start.set()
        for p in procs:
            p.join(timeout=30)
        raise RuntimeError(f"{len(failures)} of {connections} connections failed: {failures[0]}")
    window[0], window[1] = now + warmup, now + warmup + seconds
    start.set()
    rows = []
    for _ in procs:
        rows.extend(results.get(timeout=seconds + warmup + 120))
    for p in procs:
        p.join(timeout=30)
    ops = sum(r[0] for r in rows)
    errors = sum(r[1] for r in rows)
    lat = [x for r in rows for x in r[2]]
    p50, p99 = percentiles_ms(lat) if lat else (float("nan"), float("nan"))
    first = next((r[3] for r in rows if r[3]), None)
    return LoadResult(ops, seconds, p50, p99, errors, first)
