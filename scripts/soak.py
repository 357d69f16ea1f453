"""Soak: many producer connections and several consumers against one server for minutes.

The server runs as a subprocess with ``--memory-limit 1GB --cache-limit 256MB --max-live-rows
200000``. Producer connections (threads spread over worker processes, each thread its own Flight
connection) put batches of fresh samples as fast as the server acknowledges them, waiting 50 ms
after a put refused with ``table_full``; consumer connections claim micro-batches and ack them.
Loopback only; every loop is bounded by ``--seconds`` plus a drain deadline.

At the end it checks through the server: zero errors, every acknowledged sample stored exactly once
(``count(*) == count(DISTINCT …) == rows acknowledged``), every sample consumed exactly once (no
sample acked by two consumers), the backlog drained (failing if it stops shrinking for 60 s), and
the server's RSS (VmRSS, sampled every 0.5 s) stayed under ``--rss-limit-mb``. It prints a
JSON summary (samples/s, latencies, errors, RSS, the rows left to drain when the producers
stopped) for docs/reliability.md.

Usage::

    python scripts/soak.py --seconds 300 --producers 64 --consumers 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from store.settings import StoreSettings  # noqa: E402

TABLE = "soak"
PUT_ROWS = 16
CLAIM_ROWS = 64
THREADS_PER_PROCESS = 16
#: A drain fails once the backlog has not shrunk for this long.
STALL_SECONDS = 60.0
#: The server's --max-live-rows: producers that outrun the consumers by this many rows are
#: refused (table_full) and wait 50 ms before putting again, which bounds the server's index.
MAX_LIVE_ROWS = 200_000
# The server's memory bound: 2 GB, plus the window of newest blob chunks the blob store keeps
# readable from memory (StoreSettings.blob_recent_bytes), a bounded part of the read path.
RSS_LIMIT_MB = 2048 + StoreSettings().blob_recent_bytes / 2**20


# -- workers (run in their own processes) --------------------------------------------------------
def _percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    s = sorted(samples)
    return {"p50_ms": round(s[len(s) // 2] * 1000, 2),
            "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1000, 2)}


def producer_worker(uri: str, index: int, threads: int, seconds: float) -> dict[str, Any]:
    import store
    from store.errors import TableFull
    deadline = time.monotonic() + seconds
    results: list[dict[str, Any]] = [{} for _ in range(threads)]

    def run(t: int) -> None:
        s = store.connect(uri, timeout=60.0)
        latencies: list[float] = []
        errors: list[str] = []
        seq = refused = 0
        try:
            for _ in range(10_000_000):
                if time.monotonic() >= deadline:
                    break
                ids = [f"w{index}t{t}n{seq + i}_0_{i % 4}" for i in range(PUT_ROWS)]
                data = {"sample_id": ids,
                        "response": [f"answer {sid}" * (1 + (i % 8) * 10)
                                     for i, sid in enumerate(ids)],
                        "reward": [float(i % 3) for i in range(PUT_ROWS)],
                        "token_ids": [list(range(i, i + 32)) for i in range(PUT_ROWS)]}
                t0 = time.perf_counter()
                try:
                    s.put(TABLE, data)
                except TableFull:  # the server's --max-live-rows: wait for the consumers
                    refused += 1
                    time.sleep(0.05)
                    continue
                except Exception as e:  # noqa: BLE001 - every error is counted and reported
                    errors.append(repr(e)[:300])
                    if len(errors) > 20:
                        break
                    continue
                latencies.append(time.perf_counter() - t0)
                seq += PUT_ROWS
        finally:
            s.close()
        results[t] = {"prefix": f"w{index}t{t}n", "rows": seq, "errors": errors,
                      "refused": refused, "latencies": latencies}

    ths = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(seconds + 300)
    lat = [x for r in results for x in r.get("latencies", [])]
    return {"threads": [{k: v for k, v in r.items() if k != "latencies"} for r in results],
            "puts": len(lat), "put_latency": _percentiles(lat),
            "alive_threads": sum(th.is_alive() for th in ths)}


def consumer_worker(uri: str, index: int, threads: int, stop_file: str,
                    max_seconds: float) -> dict[str, Any]:
    import store
    deadline = time.monotonic() + max_seconds
    results: list[dict[str, Any]] = [{} for _ in range(threads)]

    def run(t: int) -> None:
        s = store.connect(uri, timeout=60.0)
        acked: list[str] = []
        errors: list[str] = []
        latencies: list[float] = []
        try:
            for _ in range(10_000_000):
                if time.monotonic() >= deadline or os.path.exists(stop_file):
                    break
                t0 = time.perf_counter()
                try:
                    claim = s.claim(TABLE, CLAIM_ROWS, consumer=f"c{index}t{t}")
                    if not claim:
                        time.sleep(0.005)
                        continue
                    s.ack(claim.claim_id)
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e)[:300])
                    if len(errors) > 20:
                        break
                    continue
                latencies.append(time.perf_counter() - t0)
                acked.extend(claim.data.column("sample_id").to_pylist())
        finally:
            s.close()
        results[t] = {"acked": acked, "errors": errors, "latencies": latencies}

    ths = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(max_seconds + 60)
    lat = [x for r in results for x in r.get("latencies", [])]
    return {"acked": [sid for r in results for sid in r.get("acked", [])],
            "errors": [e for r in results for e in r.get("errors", [])],
            "claim_ack_latency": _percentiles(lat), "micro_batches": len(lat),
            "alive_threads": sum(th.is_alive() for th in ths)}


# -- the driver ---------------------------------------------------------------------------------
def _spawn(args: list[str], out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args,
                             "--out", str(out)], cwd=str(ROOT), env=env,
                            stdin=subprocess.DEVNULL)


def run_soak(workdir: str | Path, *, seconds: float = 300, producers: int = 64,
             consumers: int = 8, memory_limit: str = "1GB", cache_limit: str = "256MB",
             max_live_rows: int | None = MAX_LIVE_ROWS, rss_limit_mb: float = RSS_LIMIT_MB,
             drain_seconds: float = 900, log=lambda m: None) -> dict[str, Any]:
    """Run the soak (see the module docstring); return the summary, raise AssertionError on a
    violation."""
    import store
    import reliability_helpers as rh

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    srv = rh.ServerProcess(workdir / "soak.duckdb", memory_limit=memory_limit,
                           cache_limit=cache_limit, max_live_rows=max_live_rows,
                           log_path=workdir / "server.log").start()
    rss: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.5):
            value = srv.rss_bytes()
            if value:
                rss.append(value)

    sampler = threading.Thread(target=sample, daemon=True)
    procs: list[subprocess.Popen] = []
    try:
        with store.connect(srv.uri) as admin:
            admin.create_table(TABLE, {"response": "string", "reward": "float64",
                                       "token_ids": "list<int32>"}, lease_seconds=30.0)
        sampler.start()
        stop_file = workdir / "stop"
        p_outs, c_outs = [], []
        for k in range(0, producers, THREADS_PER_PROCESS):
            out = workdir / f"producer-{k}.json"
            procs.append(_spawn(["--worker", "producer", "--uri", srv.uri, "--index", str(k),
                                 "--threads", str(min(THREADS_PER_PROCESS, producers - k)),
                                 "--seconds", str(seconds)], out))
            p_outs.append(out)
        for k in range(0, consumers, THREADS_PER_PROCESS):
            out = workdir / f"consumer-{k}.json"
            procs.append(_spawn(["--worker", "consumer", "--uri", srv.uri, "--index", str(k),
                                 "--threads", str(min(THREADS_PER_PROCESS, consumers - k)),
                                 "--stop-file", str(stop_file),
                                 "--seconds", str(seconds + drain_seconds)], out))
            c_outs.append(out)
        t0 = time.monotonic()
        n_prod = len(p_outs)
        for proc in procs[:n_prod]:
            proc.wait(timeout=seconds + 300)
        produce_seconds = time.monotonic() - t0
        with store.connect(srv.uri) as s:
            st = s.stats(TABLE)[TABLE]
            backlog = st["ready"] + st["processing"] + st["pending"]
            log(f"producers done after {produce_seconds:.1f} s; draining {backlog} rows")
            _wait_drained(s, drain_seconds)
        total_seconds = time.monotonic() - t0
        stop_file.write_text("stop")
        for proc in procs[n_prod:]:
            proc.wait(timeout=120)
        assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
        prod = [json.loads(o.read_text()) for o in p_outs]
        cons = [json.loads(o.read_text()) for o in c_outs]
        summary = _verify(srv, prod, cons)
        sampling.set()
        sampler.join(5)
        rss_max = max(rss, default=0) / 2**20
        summary.update({
            "seconds": seconds, "producer_connections": producers,
            "consumer_connections": consumers, "memory_limit": memory_limit,
            "cache_limit": cache_limit, "max_live_rows": max_live_rows,
            "write_rows_per_s": round(summary["rows"] / produce_seconds),
            "consume_rows_per_s": round(summary["rows"] / total_seconds),
            "drain_seconds": round(total_seconds - produce_seconds, 1),
            "put_latency": _merge_latency([p["put_latency"] for p in prod]),
            "claim_ack_latency": _merge_latency([c["claim_ack_latency"] for c in cons]),
            "backlog_rows": backlog, "rss_limit_mb": round(rss_limit_mb),
            "rss_max_mb": round(rss_max, 1),
            "rss_end_mb": round(rss[-1] / 2**20, 1) if rss else 0.0,
            "rss_samples": len(rss),
            # RSS at each tenth of the run: flat once DuckDB's buffer pool is warm = bounded.
            "rss_mb_by_tenth": [round(rss[min(len(rss) - 1, len(rss) * k // 10)] / 2**20)
                                for k in range(1, 11)] if rss else [],
        })
        assert summary["errors"] == 0, summary["error_examples"]
        assert rss_max < rss_limit_mb, \
            f"server RSS reached {rss_max:.0f} MB, over {rss_limit_mb:.0f} MB ({backlog} rows " \
            f"to drain when the producers stopped): {summary}"
        return summary
    finally:
        sampling.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        srv.stop()


def _merge_latency(parts: list[dict[str, float]]) -> dict[str, float]:
    """The worst per-process percentile (processes do not share samples)."""
    return {k: max((p[k] for p in parts), default=0.0) for k in ("p50_ms", "p99_ms")}


def _wait_drained(s: Any, seconds: float, stall_seconds: float = STALL_SECONDS) -> None:
    """Wait until no row is left to consume: for up to ``seconds``, and fail sooner if the
    backlog stops shrinking for ``stall_seconds`` (consumers stuck)."""
    start = time.monotonic()
    best, best_at = None, start
    while True:
        st = s.stats(TABLE)[TABLE]
        left = st["ready"] + st["processing"] + st["pending"]
        now = time.monotonic()
        if left == 0:
            return
        if best is None or left < best:
            best, best_at = left, now
        assert now - best_at < stall_seconds, \
            f"the consumers consumed nothing for {stall_seconds} s with {left} rows left"
        assert now - start < seconds, f"{left} rows left after a drain of {seconds} s"
        time.sleep(2.0)  # a stats call scans the table: polled often, it slows the drain


def _verify(srv: Any, prod: list[dict], cons: list[dict]) -> dict[str, Any]:
    import store
    import reliability_helpers as rh

    errors = [e for p in prod for t in p["threads"] for e in t.get("errors", [])]
    errors += [e for c in cons for e in c["errors"]]
    assert all(p["alive_threads"] == 0 for p in prod + cons), "worker threads did not finish"
    produced = sum(t["rows"] for p in prod for t in p["threads"])
    acked = [sid for c in cons for sid in c["acked"]]
    assert len(acked) == len(set(acked)), \
        f"{len(acked) - len(set(acked))} samples were acked by two consumers"
    with store.connect(srv.uri) as s:
        counts = s.query(rh.table_checksum_sql(TABLE, ["sample_id"])).to_pylist()[0]
        st = s.stats(TABLE)[TABLE]
    assert counts["n"] == counts["keys"] == produced, \
        f"stored {counts['n']} rows ({counts['keys']} distinct), producers got {produced} acks"
    assert st["consumed"] == len(acked) == produced, \
        f"consumed {st['consumed']}, acked {len(acked)}, produced {produced}"
    expected = {f"{t['prefix']}{n}_0_{n % PUT_ROWS % 4}" for p in prod for t in p["threads"]
                for n in range(t["rows"])}
    assert expected == set(acked), "the consumed samples are not the produced ones"
    return {"rows": produced, "consumed": len(acked), "lost": 0, "duplicated": 0,
            "errors": len(errors), "error_examples": errors[:5],
            "micro_batches": sum(c["micro_batches"] for c in cons),
            "puts": sum(p["puts"] for p in prod),
            "puts_refused": sum(t.get("refused", 0) for p in prod for t in p["threads"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--producers", type=int, default=64)
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--memory-limit", default="1GB")
    ap.add_argument("--cache-limit", default="256MB")
    ap.add_argument("--max-live-rows", type=int, default=MAX_LIVE_ROWS,
                    help="the server's --max-live-rows (0: none)")
    ap.add_argument("--rss-limit-mb", type=float, default=RSS_LIMIT_MB)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    # Internal: the worker processes.
    ap.add_argument("--worker", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("--uri", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "producer":
        result = producer_worker(args.uri, args.index, args.threads, args.seconds)
        Path(args.out).write_text(json.dumps(result))
        return 0
    if args.worker == "consumer":
        result = consumer_worker(args.uri, args.index, args.threads, args.stop_file,
                                 args.seconds)
        Path(args.out).write_text(json.dumps(result))
        return 0
    workdir = args.dir or tempfile.mkdtemp(prefix="expstore-soak-")
    summary = run_soak(workdir, seconds=args.seconds, producers=args.producers,
                       consumers=args.consumers, memory_limit=args.memory_limit,
                       cache_limit=args.cache_limit, max_live_rows=args.max_live_rows or None,
                       rss_limit_mb=args.rss_limit_mb,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
