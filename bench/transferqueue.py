"""Baseline: TransferQueue (PyPI ``transferqueue``, verl's data system: a Ray controller, ZMQ,
in-memory storage units), on a local Ray bound to 127.0.0.1.

Two workloads, as TransferQueue's own throughput test runs them and as a trainer uses it:

* its put/get throughput workload: 1,024 rows × 10 fields of 1,024 float32 (40 MiB) put in one
  call, read back by ``get_meta`` for all of them + ``get_data`` (MB/s, 1e6 bytes);
* micro-batches of 16: ``get_meta(batch_size=16)`` + ``get_data`` per micro-batch (the fetch
  also records the rows as consumed, so it is fetch and settle in one), narrow and ~12 KB rows
  (bench/workloads.py), plain (its SequentialSampler) and grouped (its GRPOGroupNSampler, groups
  of 8).

Optional: ``pip install 'transferqueue==0.1.11'`` (it brings Ray, tensordict, pyzmq, hydra;
none of its pins clash with expstore's, checked with ``pip install --dry-run``); skipped, with the
reason, when it is absent. Ray's and TransferQueue's start-up are not timed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.context import Ctx, Skip
from bench.ray_queue import local_ray, loopback_env
from bench.util import percentiles_ms
from bench.workloads import GROUP, narrow_table, wide_table

NAME = "transferqueue"
TITLE = "TransferQueue 0.1.11 (Ray + ZMQ storage units, local cluster)"

TQ_ROWS, TQ_FIELDS, TQ_WIDTH = 1024, 10, 1024       # its throughput test's workload
MICRO = 16


def tq_fields() -> dict[str, np.ndarray]:
    """The throughput workload's fields, as float32 arrays (the same values expstore puts)."""
    rng = np.random.default_rng(30)
    return {f"field_{i}": rng.standard_normal((TQ_ROWS, TQ_WIDTH), dtype=np.float32)
            for i in range(TQ_FIELDS)}


@contextlib.contextmanager
def tq_system(sampler: Any) -> Iterator[Any]:
    """TransferQueue's controller and storage units on the running Ray, with ``sampler``."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    conf = OmegaConf.create({"controller": {"sampler": sampler}}, flags={"allow_objects": True})
    tq.init(conf)
    try:
        yield tq.get_client()
    finally:
        tq.close()


def tensordict_of(columns: dict[str, Any], n: int) -> Any:
    """``n`` rows of TransferQueue fields (see :func:`micro_rows`) as one TensorDict."""
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData

    fields: dict[str, Any] = {}
    for name, values in columns.items():
        if isinstance(values, list):
            fields[name] = NonTensorData(data=values, batch_size=(n,), device=None)
        else:
            fields[name] = torch.from_numpy(np.array(values))   # writable, contiguous
    return TensorDict(fields, batch_size=(n,), device=None)


def micro_rows(kind: str, n: int) -> dict[str, Any]:
    """The narrow or wide rows of bench/workloads.py as TransferQueue fields: numbers and lists
    as tensors, text as non-tensor data."""
    table = narrow_table(n) if kind == "narrow" else wide_table(n)
    out: dict[str, Any] = {}
    for name in table.column_names:
        if name == "sample_id":
            continue
        col = table.column(name).combine_chunks()
        if name in ("token_ids", "logprobs"):
            out[name] = col.values.to_numpy().reshape(n, -1)
        elif name in ("tag", "prompt", "response"):
            out[name] = col.to_pylist()
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def micro_batches(client: Any, kind: str, n: int, group: bool) -> list[float]:
    """Durations (s) of ``n`` micro-batches of 16: get_meta + get_data."""
    rows = MICRO * (n + 5)
    data = tensordict_of(micro_rows(kind, rows), rows)
    partition = f"mb-{kind}-{'group' if group else 'plain'}"
    client.put(data=data, partition_id=partition)
    fields = list(data.keys())
    config = {"n_samples_per_prompt": GROUP} if group else None
    out: list[float] = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        meta = client.get_meta(data_fields=fields, batch_size=MICRO, partition_id=partition,
                               task_name="train", sampling_config=config)
        batch = client.get_data(meta)
        took = time.perf_counter() - t0
        if len(meta) != MICRO or batch.batch_size[0] != MICRO:
            raise RuntimeError(f"TransferQueue returned {len(meta)} rows, not {MICRO}")
        if i >= 5:
            out.append(took)
    client.clear_partition(partition)
    return out


def run(ctx: Ctx) -> None:
    loopback_env()                          # transfer_queue imports ray
    try:
        import transfer_queue  # noqa: F401
    except ImportError as e:
        raise Skip("transferqueue is not installed (pip install 'transferqueue==0.1.11'; "
                   f"see bench/transferqueue.py): {e}") from e
    import torch
    from transfer_queue import GRPOGroupNSampler, SequentialSampler

    fields = tq_fields()
    nbytes = sum(a.nbytes for a in fields.values())
    repeats = ctx.pick(2, 3)
    n = ctx.pick(30, 100)
    # its controller and each of its 2 storage units reserve a Ray CPU: more than the 2 here
    with local_ray(num_cpus=8):
        with tq_system(SequentialSampler()) as client:
            data = tensordict_of(fields, TQ_ROWS)
            puts, gets = [], []
            for rep in range(repeats):
                partition = f"tp-{rep}"
                t0 = time.perf_counter()
                client.put(data=data, partition_id=partition)
                t1 = time.perf_counter()
                meta = client.get_meta(data_fields=list(fields), batch_size=TQ_ROWS,
                                       partition_id=partition, task_name="bench")
                got = client.get_data(meta)
                t2 = time.perf_counter()
                first = got["field_0"]
                first = torch.stack(list(first.unbind())) if first.is_nested else first
                if not torch.equal(first, data["field_0"]):
                    raise RuntimeError("TransferQueue returned other values than it was given")
                puts.append(t1 - t0)
                gets.append(t2 - t1)
                client.clear_partition(partition)
            ctx.record("put_mb_per_s", nbytes / sorted(puts)[len(puts) // 2] / 1e6, "MB/s",
                       "put 1,024 rows × 10 × 1,024 float32 (40 MiB), median")
            ctx.record("get_mb_per_s", nbytes / sorted(gets)[len(gets) // 2] / 1e6, "MB/s",
                       "get_meta + get_data of them, median")
            for kind in ("narrow", "wide"):
                p50, p99 = percentiles_ms(micro_batches(client, kind, n, group=False))
                ctx.record(f"mb16_{kind}_p50_ms", p50, "ms",
                           f"micro-batch of 16 {kind}: get_meta + get_data p50")
                ctx.record(f"mb16_{kind}_p99_ms", p99, "ms", "  … p99")
        with tq_system(GRPOGroupNSampler(n_samples_per_prompt=GROUP)) as client:
            for kind in ("narrow", "wide"):
                p50, p99 = percentiles_ms(micro_batches(client, kind, n, group=True))
                ctx.record(f"mb16_{kind}_group_p50_ms", p50, "ms",
                           f"micro-batch of 16 {kind}, GRPO groups of 8 p50")
                ctx.record(f"mb16_{kind}_group_p99_ms", p99, "ms", "  … p99")
