"""Scale-out: aggregate wide ingest and micro-batch reads with N data nodes on a Ray cluster.

One Ray cluster of max(N) logical nodes on this machine, bound to 127.0.0.1; for each N a fresh
expstore cluster (``cluster_up``: a coordinator and a data node on each of N Ray nodes). Then N
producers, one Ray task pinned to each node, put wide rows (the by-reference columns go to their
node's data node, keys to the coordinator), keeping ``PUTS_IN_FLIGHT`` puts on their way
(``put_async``) as the library's ExperienceWriter does, from a common start (a barrier actor:
Ray may start a task's worker late); then N trainers, one per node, claim micro-batches of 16
(values fetched from the data nodes) and ack them pipelined (``ack_async``, as the library's
trainers do) until the table is drained. Aggregates are rows over the wall time from the common start to the last
task's end.
The coordinator's CPU (its process, every thread) per sample is measured around each phase.

Ratios are against N = 1 in the same run; the target is ≥ 0.7 × N. After each N, TransferQueue
(its controller and N storage units, which it places round-robin over the nodes) runs on the same
Ray cluster as the baseline: N producers and N trainers pinned one per node, the same rows, puts
of the same size, micro-batches of 16 by get_meta + get_data (each trainer on its producer's
partition). Every logical node shares
this machine's cores, so the ratios only mean scale-out on a machine with cores to spare (N ≤
cores / 2): N is 1, 2, 4 here, and 8 as well on a machine with 16 cores or more
(``EXPSTORE_BENCH_CLUSTER_NODES=1,2,4,8`` sets the list).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections import deque
from concurrent.futures import Future
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


def produce(uri: str, start: int, rows: int, barrier: Any) -> dict[str, Any]:
    import store
    data = wide_table(rows, start=start)
    batches = [data.slice(i, PUT_ROWS) for i in range(0, rows, PUT_ROWS)]
    with store.connect(uri) as s:
        s.describe("wide")
        s.cluster()
        _meet(barrier)
        t0 = time.time()
        # a bounded window of puts on their way, as the library's ExperienceWriter keeps
        window: deque[Future] = deque()
        for b in batches:
            window.append(s.put_async("wide", b))
            if len(window) >= PUTS_IN_FLIGHT:
                window.popleft().result()
        for put in window:
            put.result()
        return {"t0": t0, "t1": time.time(), "rows": rows, "bytes": data.nbytes}


def train(uri: str, barrier: Any) -> dict[str, Any]:
    import store
    with store.connect(uri) as s:
        s.describe("wide")
        s.cluster()
        _meet(barrier)
        t0 = time.time()
        rows = nbytes = 0
        acks = []
        took = []
        while True:
            c0 = time.perf_counter()
            c = s.claim("wide", MICRO_BATCH)
            if not c.claim_id:
                break
            took.append(time.perf_counter() - c0)
            rows += c.tables["wide"].num_rows
            nbytes += c.tables["wide"].nbytes
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


def _expstore_at(ray: Any, cluster_up: Any, root: str, ids: list[str], rows: int,
                 remotes: tuple[Any, Any, Any]) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]], list[float]]:
    """A fresh coordinator and a data node on each node of ``ids``; one producer, then one
    trainer, pinned to each: their results, and the coordinator's CPU seconds around the puts
    and around the reads."""
    remote_produce, remote_train, remote_barrier = remotes
    n, on = len(ids), _pinned(ids)
    os.makedirs(root, exist_ok=True)
    handle = cluster_up(None, db=os.path.join(root, "coord.duckdb"), port=_free_port(),
                        data_dir=os.path.join(root, "data"), nodes=ids)
    try:
        with __import__("store").connect(handle.uri) as s:
            s.create_table("wide", WIDE_COLUMNS, storage={c: "ref" for c in REF_COLUMNS})

        def cpu() -> float:
            return float(ray.get(handle.coordinator.cpu_seconds.remote()))

        barrier = remote_barrier.remote(n)
        puts = [remote_produce.options(num_cpus=0, scheduling_strategy=on(i))
                .remote(handle.uri, i * rows, rows, barrier) for i in range(n)]
        _wait_all_arrived(ray, barrier, puts, f"{n} producer(s)")
        cpu0 = cpu()
        puts = ray.get(puts, timeout=PHASE_TIMEOUT)
        cpu1 = cpu()
        barrier = remote_barrier.remote(n)
        reads = [remote_train.options(num_cpus=0, scheduling_strategy=on(i))
                 .remote(handle.uri, barrier) for i in range(n)]
        _wait_all_arrived(ray, barrier, reads, f"{n} trainer(s)")
        cpu2 = cpu()
        reads = ray.get(reads, timeout=PHASE_TIMEOUT)
        return puts, reads, [cpu0, cpu1, cpu2, cpu()]
    finally:
        handle.stop()


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
        remote_produce = ray.remote(produce)
        remote_train = ray.remote(train)
        remote_barrier = ray.remote(num_cpus=0)(Barrier)
        base: dict[str, float] = {}
        for n in counts:
            print(f"  -- N = {n}", flush=True)
            try:
                puts, reads, cpu = _expstore_at(ray, cluster_up, os.path.join(tmp, f"n{n}"),
                                                ids[:n], rows_per_node,
                                                (remote_produce, remote_train, remote_barrier))
                total = n * rows_per_node
                put_wall = max(p["t1"] for p in puts) - min(p["t0"] for p in puts)
                read_wall = max(r["t1"] for r in reads) - min(r["t0"] for r in reads)
                ingest_mb_s = sum(p["bytes"] for p in puts) / put_wall / 1e6
                read_rows_s = sum(r["rows"] for r in reads) / read_wall
                ctx.record(f"ingest_mb_s_n{n}", ingest_mb_s, "MB/s",
                           f"wide ingest, {n} node(s), aggregate")
                ctx.record(f"read_rows_s_n{n}", read_rows_s, "rows/s",
                           f"micro-batch reads (claim 16, pipelined ack), {n} node(s), aggregate")
                ctx.record(f"coord_cpu_us_put_n{n}", (cpu[1] - cpu[0]) / total * 1e6, "us",
                           f"coordinator CPU per sample put, {n} node(s)")
                ctx.record(f"coord_cpu_us_read_n{n}", (cpu[3] - cpu[2]) / max(1, sum(
                    r["rows"] for r in reads)) * 1e6, "us",
                           f"coordinator CPU per sample read, {n} node(s)")
                claim_p50, _ = percentiles_ms([t for r in reads for t in r["took"]])
                ctx.record(f"claim16_p50_ms_n{n}", claim_p50, "ms",
                           f"one claim of 16 with its values fetched, p50, {n} node(s)")
                tq = transferqueue_at(ctx, ray, _pinned(ids), n, rows_per_node, remote_barrier)
                if tq is not None:
                    suffix = "" if n == 1 else f"_n{n}"
                    ctx.record(f"tq_ingest_mb_s{suffix}", tq["ingest"], "MB/s",
                               f"TransferQueue wide ingest, {n} node(s), aggregate")
                    ctx.record(f"tq_read_rows_s{suffix}", tq["read"], "rows/s",
                               f"TransferQueue micro-batches of 16 (get_meta + get_data), {n} "
                               "node(s), aggregate")
                    ctx.record(f"ingest_vs_tq{suffix}", ingest_mb_s / tq["ingest"], "x",
                               f"our wide ingest vs TransferQueue's, {n} node(s)")
                    ctx.record(f"read_vs_tq{suffix}", read_rows_s / tq["read"], "x",
                               f"our micro-batch reads vs TransferQueue's, {n} node(s)")
                    if n == 1:
                        ctx.record("mb16_p50_tq_over_expstore", tq["claim_p50_ms"] / claim_p50,
                                   "x", "micro-batch of 16 p50: TransferQueue / expstore (one node)")
                if not base:
                    base = {"ingest": ingest_mb_s / n, "read": read_rows_s / n,
                            "claim_p50_ms": claim_p50}
                else:
                    ctx.record(f"ingest_ratio_n{n}", ingest_mb_s / base["ingest"], "x",
                               f"ingest vs one node's, {n} nodes (target ≥ {0.7 * n:.1f})")
                    ctx.record(f"read_ratio_n{n}", read_rows_s / base["read"], "x",
                               f"reads vs one node's, {n} nodes (target ≥ {0.7 * n:.1f})")
            except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
                # a failed N (a task that died or never met the others) is reported, and the
                # other N still run
                print(f"  N = {n} failed: {type(e).__name__}: {str(e)[:500]}")
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


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


def transferqueue_at(ctx: Ctx, ray: Any, on: Any, n: int, rows: int,
                     remote_barrier: Any) -> dict[str, float] | None:
    """TransferQueue on the same Ray cluster with n nodes' worth of the same load: its
    controller, n storage units (its default places them round-robin over the nodes), n
    producers and n trainers pinned one per node as ours are, each producer/trainer pair on
    its own partition (no contention between trainers: easier than our one shared table)."""
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
    # one call per worker: a reused worker would keep the client of the controller before
    produce_task = ray.remote(max_calls=1)(tq_produce)
    train_task = ray.remote(max_calls=1)(tq_train)
    tq.init(conf)
    try:
        barrier = remote_barrier.remote(n)
        puts = [produce_task.options(num_cpus=0, scheduling_strategy=on(i))
                .remote(f"agg-{i}", i * rows, rows, barrier) for i in range(n)]
        puts = ray.get(puts, timeout=PHASE_TIMEOUT)
        batches = ctx.pick(16, 128)
        barrier = remote_barrier.remote(n)
        reads = ray.get([train_task.options(num_cpus=0, scheduling_strategy=on(i))
                         .remote(f"agg-{i}", batches, barrier) for i in range(n)],
                        timeout=PHASE_TIMEOUT)
    finally:
        tq.close()
    put_wall = max(p["t1"] for p in puts) - min(p["t0"] for p in puts)
    read_wall = max(r["t1"] for r in reads) - min(r["t0"] for r in reads)
    p50, _ = percentiles_ms([t for r in reads for t in r["took"]])
    return {"ingest": sum(p["bytes"] for p in puts) / put_wall / 1e6,
            "read": sum(r["rows"] for r in reads) / read_wall, "claim_p50_ms": p50}
