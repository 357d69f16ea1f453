"""Scale-out: aggregate wide ingest and micro-batch reads with N data nodes on a Ray cluster.

One Ray cluster of max(N) logical nodes on this machine, bound to 127.0.0.1; for each N a fresh
expstore cluster (``cluster_up``: a coordinator and a data node on each of N Ray nodes) and,
beside it on the same Ray cluster, TransferQueue as the baseline (its controller and N storage
units, which it places round-robin over the nodes).

Ingest: N producers, one Ray task pinned to each node, put the same wide rows in puts of
``PUT_ROWS`` from a common start (a barrier actor: Ray may start a task's worker late). Ours send
the by-reference columns to their node's data node and the keys to the coordinator, keeping
``PUTS_IN_FLIGHT`` puts on their way (``put_async``) as the library's ExperienceWriter does.
One such phase is short, so on shared cores one phase's figure is mostly the load of the
moment: each system runs ``INGEST_ROUNDS`` phases (``INGEST_ROUNDS_QUICK`` with --quick), ours
and TransferQueue's alternated and who goes first swapped each round, each round into a fresh
table (ours) or fresh partitions (TransferQueue's) with the same rows. The ingest figures are
the medians of each system's rounds (the per-round figures are printed, and kept as the series
``ingest_rounds_n{N}``), and ``ingest_vs_tq`` is the ratio of the two medians.

Reads, one phase a system after the rounds, on round 0's rows: N trainers, one per node, claim
micro-batches of 16 (values fetched from the data nodes) and ack them pipelined (``ack_async``,
as the library's trainers do) until the table is drained; TransferQueue's take micro-batches of
16 by get_meta + get_data, each trainer on its producer's partition. Aggregates are rows (or
bytes) over the wall time from the common start to the last task's end.

The coordinator's CPU (its process, every thread) per sample is measured around each of our
ingest rounds (the median of the rounds is recorded) and around our read phase.

Ratios are against N = 1 in the same run; the target is ≥ 0.7 × N. Every logical node shares
this machine's cores, so the ratios only mean scale-out on a machine with cores to spare (N ≤
cores / 2): N is 1, 2, 4 here, and 8 as well on a machine with 16 cores or more
(``EXPSTORE_BENCH_CLUSTER_NODES=1,2,4,8`` sets the list).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

from bench.context import Ctx, Skip
# (imports no TransferQueue or Ray: those are imported where they run)
from bench.transferqueue import micro_rows, tensordict_of
from bench.util import percentiles_ms
from bench.workloads import WIDE_COLUMNS, wide_table
from producers.writer import PUTS_IN_FLIGHT

NAME = "cluster"
TITLE = "Scale-out on Ray: N data nodes (aggregate ingest, micro-batch reads)"

MICRO_BATCH = 16
PUT_ROWS = 256
REF_COLUMNS = ("prompt", "response", "token_ids", "logprobs")
#: ingest phases each system runs at each N, ours and TransferQueue's alternated (the module's
#: docstring says why)
INGEST_ROUNDS = 3
INGEST_ROUNDS_QUICK = 2


def node_counts(ctx: Ctx) -> list[int]:
    env = os.environ.get("EXPSTORE_BENCH_CLUSTER_NODES")
    if env:
        return sorted({int(x) for x in env.split(",") if x.strip()})
    counts = [1, 2] if ctx.quick else [1, 2, 4]
    if (os.cpu_count() or 1) >= 16 and not ctx.quick:
        counts.append(8)
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Barrier:
    """A Ray actor the tasks of a phase meet at: the last to arrive sets the common start, so a
    worker that Ray started late does not stretch the phase's wall time."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = 0
        self.start_at: float | None = None

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == self.parties:
            self.start_at = time.time() + 0.5

    def start(self) -> float | None:
        return self.start_at

    def arrived_count(self) -> int:
        return self.arrived


def _meet(barrier: Any) -> None:
    import ray
    ray.get(barrier.arrive.remote())
    while (start_at := ray.get(barrier.start.remote())) is None:
        time.sleep(0.05)
    time.sleep(max(0.0, start_at - time.time()))


def produce(uri: str, table: str, start: int, rows: int, barrier: Any) -> dict[str, Any]:
    import store
    data = wide_table(rows, start=start)
    batches = [data.slice(i, PUT_ROWS) for i in range(0, rows, PUT_ROWS)]
    with store.connect(uri) as s:
        s.describe(table)
        s.cluster()
        _meet(barrier)
        t0 = time.time()
        # a bounded window of puts on their way, as the library's ExperienceWriter keeps
        window: deque[Future] = deque()
        for b in batches:
            window.append(s.put_async(table, b))
            if len(window) >= PUTS_IN_FLIGHT:
                window.popleft().result()
        for put in window:
            put.result()
        return {"t0": t0, "t1": time.time(), "rows": rows, "bytes": data.nbytes}


def train(uri: str, table: str, barrier: Any) -> dict[str, Any]:
    import store
    with store.connect(uri) as s:
        s.describe(table)
        s.cluster()
        _meet(barrier)
        t0 = time.time()
        rows = nbytes = 0
        acks = []
        took = []
        while True:
            c0 = time.perf_counter()
            c = s.claim(table, MICRO_BATCH)
            if not c.claim_id:
                break
            took.append(time.perf_counter() - c0)
            rows += c.tables[table].num_rows
            nbytes += c.tables[table].nbytes
            acks.append(s.ack_async(c.claim_id))   # pipelined, as the library's trainers ack
        for a in acks:
            a.result()
        return {"t0": t0, "t1": time.time(), "rows": rows, "bytes": nbytes, "took": took,
                "local": s.fetch_stats["local_fetches"], "fetches": s.fetch_stats["fetches"]}


#: how long a phase's tasks may take to meet, and to finish, before the phase is reported failed
PHASE_TIMEOUT = 90.0


def _wait_all_arrived(ray: Any, barrier: Any, tasks: list[Any], what: str) -> None:
    """Until every task of the phase is connected and waiting (so CPU is counted from there).
    A task that failed before it arrived raises here, and one that never arrives times out,
    instead of leaving the bench waiting for ever."""
    deadline = time.monotonic() + PHASE_TIMEOUT
    while ray.get(barrier.start.remote()) is None:
        done, _ = ray.wait(tasks, num_returns=len(tasks), timeout=0)
        if done:
            ray.get(done)                   # a task that ended before the start: its error
            raise RuntimeError(f"{what}: {len(done)} task(s) ended before the common start")
        if time.monotonic() > deadline:
            arrived = ray.get(barrier.arrived_count.remote())
            raise TimeoutError(f"{what}: {arrived} of {len(tasks)} tasks met in "
                               f"{PHASE_TIMEOUT:.0f} s")
        time.sleep(0.05)


def _pinned(ids: list[str]) -> Any:
    """A scheduling strategy pinning a task to node ``i`` of ``ids``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def on(i: int) -> Any:
        return NodeAffinitySchedulingStrategy(ids[i], soft=False)
    return on


def _mb_s(puts: list[dict[str, Any]]) -> float:
    """A put phase's aggregate: its bytes over the wall from the common start to the last end."""
    return sum(p["bytes"] for p in puts) / (max(p["t1"] for p in puts)
                                            - min(p["t0"] for p in puts)) / 1e6


def _rows_s(reads: list[dict[str, Any]]) -> float:
    return sum(r["rows"] for r in reads) / (max(r["t1"] for r in reads)
                                            - min(r["t0"] for r in reads))


class ExpstoreAt:
    """A fresh expstore cluster: a coordinator and a data node on each node of ``ids``. Each
    ingest round puts into a table of its own; the read phase drains one of them."""

    def __init__(self, ray: Any, cluster_up: Any, root: str, ids: list[str],
                 remotes: tuple[Any, Any, Any]) -> None:
        self.ray, self.n, self.on = ray, len(ids), _pinned(ids)
        self.remote_produce, self.remote_train, self.remote_barrier = remotes
        os.makedirs(root, exist_ok=True)
        self.handle = cluster_up(None, db=os.path.join(root, "coord.duckdb"), port=_free_port(),
                                 data_dir=os.path.join(root, "data"), nodes=ids)

    def _cpu(self) -> float:
        return float(self.ray.get(self.handle.coordinator.cpu_seconds.remote()))

    def ingest(self, table: str, rows: int) -> tuple[list[dict[str, Any]], float]:
        """One producer pinned to each node puts ``rows`` rows into the new ``table``: their
        results, and the coordinator's CPU seconds around the puts."""
        import store
        with store.connect(self.handle.uri) as s:
            s.create_table(table, WIDE_COLUMNS, storage={c: "ref" for c in REF_COLUMNS})
        barrier = self.remote_barrier.remote(self.n)
        puts = [self.remote_produce.options(num_cpus=0, scheduling_strategy=self.on(i))
                .remote(self.handle.uri, table, i * rows, rows, barrier) for i in range(self.n)]
        _wait_all_arrived(self.ray, barrier, puts, f"{self.n} producer(s)")
        cpu0 = self._cpu()
        puts = self.ray.get(puts, timeout=PHASE_TIMEOUT)
        return puts, self._cpu() - cpu0

    def read(self, table: str) -> tuple[list[dict[str, Any]], float]:
        """One trainer pinned to each node claims ``table`` until it is drained: their
        results, and the coordinator's CPU seconds around the reads."""
        barrier = self.remote_barrier.remote(self.n)
        reads = [self.remote_train.options(num_cpus=0, scheduling_strategy=self.on(i))
                 .remote(self.handle.uri, table, barrier) for i in range(self.n)]
        _wait_all_arrived(self.ray, barrier, reads, f"{self.n} trainer(s)")
        cpu0 = self._cpu()
        reads = self.ray.get(reads, timeout=PHASE_TIMEOUT)
        return reads, self._cpu() - cpu0

    def stop(self) -> None:
        self.handle.stop()


def run(ctx: Ctx) -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as e:
        raise Skip("ray not installed (pip install 'expstore[cluster]')") from e
    from flight_server.cluster.ray_cluster import cluster_up

    counts = node_counts(ctx)
    # with a quarter of this, a phase on many cores was over too soon to measure more than
    # start-up jitter (docs/bench/history.md, "The scale-out runs of 2026-11-26")
    rows_per_node = ctx.pick(512, 8192)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    tmp = tempfile.mkdtemp(prefix="expstore-bench-cluster-")
    try:
        for _ in range(max(counts) - 1):
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, namespace="expstore", log_to_driver=False)
        alive = [n for n in ray.nodes() if n["Alive"]]
        addresses = {n["NodeManagerAddress"] for n in alive}
        if addresses != {"127.0.0.1"}:
            raise Skip(f"Ray bound {sorted(addresses)}, not only 127.0.0.1")
        ids = [n["NodeID"] for n in alive]
        remotes = (ray.remote(produce), ray.remote(train), ray.remote(num_cpus=0)(Barrier))
        base: dict[str, float] = {}
        for n in counts:
            print(f"  -- N = {n}", flush=True)
            root = os.path.join(tmp, f"n{n}")
            try:
                with ExitStack() as running:
                    ours = ExpstoreAt(ray, cluster_up, root, ids[:n], remotes)
                    running.callback(ours.stop)
                    tq = TransferQueueAt.start(ray, _pinned(ids), n, remotes[2])
                    if tq is not None:
                        running.callback(tq.close)
                    base = _measure_n(ctx, n, rows_per_node, ours, tq, base)
            except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
                # a failed N (a task that died or never met the others) is reported, and the
                # other N still run
                print(f"  N = {n} failed: {type(e).__name__}: {str(e)[:500]}")
            shutil.rmtree(root, ignore_errors=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _measure_n(ctx: Ctx, n: int, rows: int, ours: ExpstoreAt, tq: TransferQueueAt | None,
               base: dict[str, float]) -> dict[str, float]:
    """One N: the ingest rounds, ours and TransferQueue's alternated, then one read phase each
    on round 0's rows; records the figures and returns one node's (``base``, set at the first
    N)."""
    total = n * rows
    ingest: list[float] = []
    cpu_put: list[float] = []
    tq_ingest: list[float] = []

    def ours_round(r: int) -> None:
        puts, cpu = ours.ingest(f"wide_r{r}", rows)
        ingest.append(_mb_s(puts))
        cpu_put.append(cpu / total * 1e6)

    def tq_round(r: int) -> None:
        if tq is not None:
            tq_ingest.append(_mb_s(tq.ingest(f"r{r}", rows)))

    for r in range(ctx.pick(INGEST_ROUNDS_QUICK, INGEST_ROUNDS)):
        # each round swaps who goes first, so a drift in the machine's load falls on both
        ours_first = r % 2 == 0
        for phase in (ours_round, tq_round) if ours_first else (tq_round, ours_round):
            phase(r)
        line = f"    ingest round {r + 1} ({'ours' if ours_first else 'TransferQueue'} first): " \
               f"ours {ingest[-1]:.1f} MB/s"
        if tq_ingest:
            line += f", TransferQueue {tq_ingest[-1]:.1f} MB/s, {ingest[-1] / tq_ingest[-1]:.2f}x"
        print(line, flush=True)
    ctx.series(f"ingest_rounds_n{n}", {"expstore_mb_s": ingest, "tq_mb_s": tq_ingest,
                                       "coord_cpu_us_put": cpu_put})
    ingest_mb_s = statistics.median(ingest)
    reads, cpu_read = ours.read("wide_r0")
    read_rows_s = _rows_s(reads)
    rounds = f"median of {len(ingest)} rounds"
    ctx.record(f"ingest_mb_s_n{n}", ingest_mb_s, "MB/s",
               f"wide ingest, {n} node(s), aggregate, {rounds}")
    ctx.record(f"read_rows_s_n{n}", read_rows_s, "rows/s",
               f"micro-batch reads (claim 16, pipelined ack), {n} node(s), aggregate")
    ctx.record(f"coord_cpu_us_put_n{n}", statistics.median(cpu_put), "us",
               f"coordinator CPU per sample put, {n} node(s), {rounds}")
    ctx.record(f"coord_cpu_us_read_n{n}",
               cpu_read / max(1, sum(r["rows"] for r in reads)) * 1e6, "us",
               f"coordinator CPU per sample read, {n} node(s)")
    claim_p50, _ = percentiles_ms([t for r in reads for t in r["took"]])
    ctx.record(f"claim16_p50_ms_n{n}", claim_p50, "ms",
               f"one claim of 16 with its values fetched, p50, {n} node(s)")
    if tq is not None:
        tq_reads = tq.read("r0", ctx.pick(16, 128))
        tq_ingest_mb_s, tq_read_rows_s = statistics.median(tq_ingest), _rows_s(tq_reads)
        suffix = "" if n == 1 else f"_n{n}"
        ctx.record(f"tq_ingest_mb_s{suffix}", tq_ingest_mb_s, "MB/s",
                   f"TransferQueue wide ingest, {n} node(s), aggregate, {rounds}")
        ctx.record(f"tq_read_rows_s{suffix}", tq_read_rows_s, "rows/s",
                   f"TransferQueue micro-batches of 16 (get_meta + get_data), {n} "
                   "node(s), aggregate")
        ctx.record(f"ingest_vs_tq{suffix}", ingest_mb_s / tq_ingest_mb_s, "x",
                   f"our wide ingest vs TransferQueue's, {n} node(s), medians")
        ctx.record(f"read_vs_tq{suffix}", read_rows_s / tq_read_rows_s, "x",
                   f"our micro-batch reads vs TransferQueue's, {n} node(s)")
        if n == 1:
            tq_p50, _ = percentiles_ms([t for r in tq_reads for t in r["took"]])
            ctx.record("mb16_p50_tq_over_expstore", tq_p50 / claim_p50,
                       "x", "micro-batch of 16 p50: TransferQueue / expstore (one node)")
    if not base:
        return {"ingest": ingest_mb_s / n, "read": read_rows_s / n}
    ctx.record(f"ingest_ratio_n{n}", ingest_mb_s / base["ingest"], "x",
               f"ingest vs one node's, {n} nodes (target ≥ {0.7 * n:.1f})")
    ctx.record(f"read_ratio_n{n}", read_rows_s / base["read"], "x",
               f"reads vs one node's, {n} nodes (target ≥ {0.7 * n:.1f})")
    return base


def tq_produce(partition: str, start: int, rows: int, barrier: Any) -> dict[str, Any]:
    """One TransferQueue producer: the same wide rows as :func:`produce`, in puts of PUT_ROWS."""
    import transfer_queue as tq
    tq.init()                               # attaches to the running controller
    client = tq.get_client()
    data = tensordict_of(micro_rows("wide", rows), rows)
    puts = [data[i:i + PUT_ROWS] for i in range(0, rows, PUT_ROWS)]
    _meet(barrier)
    t0 = time.time()
    for part in puts:
        client.put(data=part, partition_id=partition)
    return {"t0": t0, "t1": time.time(), "rows": rows,
            "bytes": wide_table(rows, start=start).nbytes}  # the same sizes as ours


def tq_train(partition: str, batches: int, barrier: Any) -> dict[str, Any]:
    """One TransferQueue trainer: ``batches`` micro-batches of 16 (get_meta + get_data, which
    also marks them consumed) from its producer's partition."""
    import transfer_queue as tq
    tq.init()
    client = tq.get_client()
    fields = [c for c in WIDE_COLUMNS if c != "sample_id"]
    _meet(barrier)
    t0 = time.time()
    rows, took = 0, []
    for _ in range(batches):
        c0 = time.perf_counter()
        meta = client.get_meta(data_fields=fields, batch_size=MICRO_BATCH,
                               partition_id=partition, task_name="train")
        batch = client.get_data(meta)
        took.append(time.perf_counter() - c0)
        rows += batch.batch_size[0]
    return {"t0": t0, "t1": time.time(), "rows": rows, "took": took}


class TransferQueueAt:
    """TransferQueue on the same Ray cluster with n nodes' worth of the same load: its
    controller, n storage units (its default places them round-robin over the nodes), n
    producers and n trainers pinned one per node as ours are, each producer/trainer pair on
    its own partition (no contention between trainers: easier than our one shared table).
    Each ingest round puts into partitions of its own."""

    def __init__(self, ray: Any, on: Any, n: int, remote_barrier: Any, tq: Any) -> None:
        self.ray, self.on, self.n, self.remote_barrier, self.tq = ray, on, n, remote_barrier, tq
        # one call per worker: a reused worker would keep the client of the controller before
        self.produce_task = ray.remote(max_calls=1)(tq_produce)
        self.train_task = ray.remote(max_calls=1)(tq_train)

    @classmethod
    def start(cls, ray: Any, on: Any, n: int, remote_barrier: Any) -> TransferQueueAt | None:
        """Its controller and n storage units, or None (said why) where it is not installed."""
        try:
            import transfer_queue as tq
            from omegaconf import OmegaConf
            from transfer_queue import SequentialSampler
        except ImportError as e:
            print(f"  TransferQueue baseline skipped: {e} (pip install 'transferqueue==0.1.11')")
            return None
        conf = OmegaConf.create({"controller": {"sampler": SequentialSampler()},
                                 "backend": {"SimpleStorage": {"num_data_storage_units": n}}},
                                flags={"allow_objects": True})
        tq.init(conf)
        return cls(ray, on, n, remote_barrier, tq)

    def ingest(self, prefix: str, rows: int) -> list[dict[str, Any]]:
        barrier = self.remote_barrier.remote(self.n)
        return self.ray.get([self.produce_task.options(num_cpus=0, scheduling_strategy=self.on(i))
                             .remote(f"{prefix}-{i}", i * rows, rows, barrier)
                             for i in range(self.n)], timeout=PHASE_TIMEOUT)

    def read(self, prefix: str, batches: int) -> list[dict[str, Any]]:
        barrier = self.remote_barrier.remote(self.n)
        return self.ray.get([self.train_task.options(num_cpus=0, scheduling_strategy=self.on(i))
                             .remote(f"{prefix}-{i}", batches, barrier) for i in range(self.n)],
                            timeout=PHASE_TIMEOUT)

    def close(self) -> None:
        self.tq.close()
