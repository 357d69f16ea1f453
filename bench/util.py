"""Small helpers shared by the benchmarks: latency percentiles, loopback ports, process memory."""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


def spawn_context() -> Any:
    # Forking after a gRPC client exists in the parent can hang the child: always spawn.
    return multiprocessing.get_context("spawn")


def percentiles_ms(samples_s: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds of durations given in seconds."""
    xs = sorted(samples_s)
    if not xs:
        raise ValueError("no latency samples")

    def q(p: float) -> float:
        # nearest-rank percentile: a p99 of 1,000 samples is the 990th, not an interpolation
        i = min(len(xs) - 1, max(0, int(round(p * len(xs) + 0.5)) - 1))
        return xs[i] * 1e3

    return q(0.50), q(0.99)


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 50) -> list[float]:
    """Durations in seconds of ``n`` sequential calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def run_for(fn: Callable[[], Any], budget_s: float, max_n: int, warmup: int = 5,
            min_n: int = 20) -> list[float]:
    """Durations (s) of sequential ``fn()`` calls: at most ``max_n``, stopping once ``budget_s``
    has passed (but not before ``min_n``), so a slow system costs time, not the whole run."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    clock = time.perf_counter
    end = clock() + budget_s
    while len(out) < max_n and (len(out) < min_n or clock() < end):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def median_rate(amount: float, run: Callable[[], object], repeats: int) -> float:
    """Median of ``amount / seconds`` over ``repeats`` timed runs of ``run``."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        rates.append(amount / (time.perf_counter() - t0))
    return statistics.median(rates)


def free_port() -> int:
    """A loopback port that was free a moment ago (only for servers that cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30.0, alive: Callable[[], bool] | None = None) -> None:
    """Poll until something accepts TCP connections on ``127.0.0.1:port``.

    Raises:
        RuntimeError: ``alive()`` turned false (the server died) or ``timeout`` passed.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"server on port {port} exited before it accepted connections")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing accepted connections on {HOST}:{port} within {timeout:.0f} s")


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (1e6 bytes), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for pid {pid}")


def available_mb() -> float | None:
    """Memory the machine can still give (MemAvailable) in MB (1e6 bytes); None without /proc."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        return None
    return None


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (psutil when present, else /proc of pid)."""
    try:
        import psutil
    except ImportError:
        return rss_mb(pid)
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 1e6


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"
