"""GPU training fed by the store: a DeepSpeed engine on CUDA, its micro-batches from a Flight
subscription, against the same loop fed from memory.

The model is a byte-level causal LM built in code (:func:`producers.rollout.tiny_lm.build_tiny_lm`,
d_model 768, 6 layers, ~44 M parameters), trained in bf16 autocast with the GRPO clipped loss on
wide rows (1 KB prompt and 3 KB response text, 1,024 token ids, 1,024 logprobs; token ids folded
into the byte vocabulary). Micro-batches are one group of 8 trajectories, 16 to a global batch;
each global batch ends with ``engine.step()``, the weights published (to /dev/shm where it
exists, so that the disk does not dominate) and a version bump, as
:class:`consumers.deepspeed_loop.DeepSpeedTrainLoop` does in a real run.

Two feeds of the same loop, alternated: **memory** (the micro-batch tables already in the trainer
process: the loop with no store in it) and **store** (the rows put into the expstore
server beforehand, all ready and kept ready through the phase's bumps by the table's staleness
bound, delivered by a group-aware subscription that the server pushes ahead of the trainer,
acked after each backward, the version bumped at each boundary).
The ratio of their step rates is the store's cost to a GPU trainer; the time the loop spent in
the store's three parts of a step (waiting for the next micro-batch, acks, the bump) says where
it went.

Needs torch with a CUDA device and DeepSpeed; skipped with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench import expstore_server
from bench.context import Ctx, Skip
from bench.util import free_port
from bench.workloads import GROUP, TOKENS, WIDE_COLUMNS, mb, wide_table

NAME = "gpu_train"
TITLE = "DeepSpeed on a GPU fed by the store vs from memory"

MICRO = GROUP  # one group of trajectories per micro-batch
GLOBAL = 16 * MICRO  # enough compute per step that publishing the weights is not all of it
PROMPT_TOKENS = 256
COLUMNS = {**WIDE_COLUMNS, "prompt_len": "int32", "reward": "float64"}


def _require() -> tuple[Any, Any]:
    # Asked in a child process: torch imported into this one, after the store has created a
    # catalog (DuckDB under SQLAlchemy), makes the interpreter's exit print nanobind's leak
    # report for DuckDB's objects, a harmless teardown-order effect that reads like a bug.
    probe = subprocess.run(
        [sys.executable, "-c",
         "import torch; print(torch.__version__, int(torch.cuda.is_available()))"],
        capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise Skip(f"torch is not importable ({last})")
    version, cuda = probe.stdout.split()[-2:]
    if cuda != "1":
        raise Skip(f"needs a CUDA device; torch {version} sees none")
    import torch
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - its import fails in many ways (no compiler, no ops)
        raise Skip(f"deepspeed is not importable ({type(e).__name__}: {e})") from e
    return torch, deepspeed


def train_rows(n: int, start: int = 0) -> pa.Table:
    """Wide rows a byte-level model can train on: ids folded into 0..255, a prompt length, a reward."""
    t = wide_table(n, start)
    ids = t.column("token_ids").combine_chunks()
    folded = pa.ListArray.from_arrays(ids.offsets, pa.array(ids.values.to_numpy() % 256, pa.int32()))
    rng = np.random.default_rng(start)
    return (t.set_column(t.schema.get_field_index("token_ids"), "token_ids", folded)
             .append_column("prompt_len", pa.array(np.full(n, PROMPT_TOKENS, np.int32)))
             .append_column("reward", pa.array(rng.integers(0, 2, n).astype(np.float64))))


@dataclass
class _Item:
    """A micro-batch from memory, shaped like the subscription's."""

    data: pa.Table
    index: int
    is_boundary: bool

    def ack(self, wait: bool = True) -> None:
        pass


def _memory_feed(rows: pa.Table) -> Iterator[_Item]:
    input_ids = pa.array([s.rsplit("_", 2)[0] for s in rows.column("sample_id").to_pylist()])
    rows = rows.append_column("input_id", input_ids)
    per_global = GLOBAL // MICRO
    for i, start in enumerate(range(0, rows.num_rows - MICRO + 1, MICRO)):
        yield _Item(rows.slice(start, MICRO), i % per_global, i % per_global == per_global - 1)


class _Timed:
    """Wraps a micro-batch iterable and a bump: adds up the seconds the loop spent waiting for a
    micro-batch, in acks and in bumps (the store's three parts of a training step)."""

    def __init__(self, items: Iterable[Any], bump: Any) -> None:
        self._it = iter(items)
        self._bump = bump
        self.seconds = {"waiting": 0.0, "acks": 0.0, "bumps": 0.0}

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._timing("waiting"):
            return _TimedItem(next(self._it), self)

    def bump(self, **kwargs: Any) -> Any:
        with self._timing("bumps"):
            return self._bump(**kwargs)

    @contextlib.contextmanager
    def _timing(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t0


@dataclass
class _TimedItem:
    mb: Any
    timer: _Timed

    @property
    def data(self) -> pa.Table:
        return self.mb.data

    @property
    def index(self) -> int:
        return int(self.mb.index)

    @property
    def is_boundary(self) -> bool:
        return bool(self.mb.is_boundary)

    def ack(self, wait: bool = True) -> Any:
        with self.timer._timing("acks"):
            return self.mb.ack(wait)


def _set_dist_env() -> None:
    # DeepSpeed needs a process group; a single process on one GPU is world size 1.
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(key, value)


def _phase(loop: Any, timed: _Timed, warmup: int, steps: int) -> tuple[list[float], dict[str, float]]:
    """Seconds of each global batch after the warm-up ones, and the fraction of them spent
    waiting for micro-batches, in acks and in bumps."""
    stamps, parts = [], []
    for _ in loop.run(timed, timed.bump, max_steps=warmup + steps):
        # the step published the weights (a copy to the host): the GPU is idle here
        stamps.append(time.perf_counter())
        parts.append(dict(timed.seconds))
    span = stamps[-1] - stamps[warmup - 1]
    fractions = {k: (parts[-1][k] - parts[warmup - 1][k]) / span for k in parts[-1]}
    return np.diff(stamps[warmup - 1:]).tolist(), fractions


def run(ctx: Ctx) -> None:
    _require()
    from producers.rollout.tiny_lm import TinyLMConfig

    measure(ctx, "cuda", TinyLMConfig(d_model=768, n_layers=6, n_heads=12, max_seq_len=TOKENS))


def measure(ctx: Ctx, device_type: str, config: Any) -> None:
    """Train ``config``'s model on DeepSpeed's accelerator (``device_type``: cuda or cpu)."""
    import deepspeed
    import torch

    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config
    from consumers.grpo import clipped_policy_loss, token_logprobs
    from flight_server.client import RemoteStore
    from producers.rollout.tiny_lm import build_tiny_lm
    from producers.rollout.weights import publish_state_dict

    steps = ctx.pick(3, 10)
    rounds = 2  # memory, store, memory, store: drift (clocks, caches) falls on both
    warmup = 2
    _set_dist_env()
    model = build_tiny_lm(seed=0, config=config)
    params = sum(p.numel() for p in model.parameters())
    # bf16 autocast as DeepSpeed runs it (an autocast around the engine's forward is switched
    # off inside it); parameters, gradients and AdamW's state stay float32
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
        config=deepspeed_config(micro_batch_size=MICRO, global_batch_size=GLOBAL, extra={
            "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}))
    gpu = torch.cuda.get_device_name(engine.device) if device_type == "cuda" else device_type
    print(f"  {gpu}; model {params / 1e6:.1f} M parameters, micro-batch {MICRO} x {TOKENS} "
          f"tokens, {GLOBAL // MICRO} per global batch", flush=True)

    def loss_fn(eng: Any, b: Any) -> tuple[Any, Any]:
        lp = token_logprobs(eng(b.input_ids, b.position_ids).float(), b.input_ids)
        return clipped_policy_loss(lp, b.old_logprobs, b.per_token(b.advantages), b.loss_mask)

    shm = Path("/dev/shm")
    weights = Path(tempfile.mkdtemp(prefix="expstore-gpu-train-",
                                    dir=shm if shm.is_dir() else None))
    per_phase = (warmup + steps) * GLOBAL
    rows = train_rows(per_phase)
    print(f"  {rows.num_rows} rows per phase, {mb(rows) / rows.num_rows * 1e3:.1f} KB each",
          flush=True)
    remote = RemoteStore(expstore_server.uri(ctx))
    timings: dict[str, list[float]] = {"memory": [], "store": []}
    spent: dict[str, list[dict[str, float]]] = {"memory": [], "store": []}
    try:
        for r in range(rounds):
            for feed in ("memory", "store"):
                sub = None
                if feed == "memory":
                    timed = _Timed(_memory_feed(rows), lambda **_: None)  # no store, no version
                else:
                    table = expstore_server.table_name("gpu_train")
                    # every row is written up front, at version 0: let the phase's bumps keep them
                    remote.create_table(table, COLUMNS, max_staleness=warmup + steps)
                    remote.put(table, rows)
                    sub = remote.subscribe(table, MICRO, GLOBAL, group_by="input_id",
                                           group_size=GROUP, consumer=f"gpu-{r}")
                    timed = _Timed(sub, sub.bump_version)
                loop = DeepSpeedTrainLoop(engine, loss_fn, weights, name=f"{feed}{r}", keep_last=2)
                try:
                    step_s, fractions = _phase(loop, timed, warmup, steps)
                finally:
                    if sub is not None:
                        sub.close()
                timings[feed].extend(step_s)
                spent[feed].append(fractions)
                print(f"  round {r + 1} {feed:<6}: {1e3 * statistics.median(step_s):7.1f} ms per "
                      f"global batch (median of {len(step_s)}); of it " + ", ".join(
                          f"{part} {100 * f:.1f}%" for part, f in fractions.items()), flush=True)
        publish_s = []
        for step in range(3):
            t0 = time.perf_counter()
            publish_state_dict(engine.module.state_dict(), weights, step, name="timing")
            publish_s.append(time.perf_counter() - t0)
    finally:
        remote.close()
        for f in weights.iterdir():
            f.unlink()
        weights.rmdir()

    tokens = GLOBAL * TOKENS
    mem_ms = 1e3 * statistics.median(timings["memory"])
    store_ms = 1e3 * statistics.median(timings["store"])
    ctx.record("memory_step_ms", mem_ms, "ms", "global batch fed from memory, median")
    ctx.record("store_step_ms", store_ms, "ms", "global batch fed by the store, median")
    ctx.record("memory_tokens_per_s", tokens / mem_ms * 1e3, "tokens/s", "tokens/s from memory")
    ctx.record("store_tokens_per_s", tokens / store_ms * 1e3, "tokens/s", "tokens/s from the store")
    ctx.record("store_vs_memory", mem_ms / store_ms, "x", "store-fed step rate / memory-fed")
    ctx.record("publish_ms", 1e3 * statistics.median(publish_s), "ms",
               "of a step: publishing the weights (both feeds), median")
    for part in ("waiting", "acks", "bumps"):
        ctx.record(f"store_{part}_fraction", 100 * statistics.mean(f[part] for f in spent["store"]),
                   "%", f"of a store-fed step: {part}")
    ctx.series("steps", {"gpu": gpu, "params": params, "ms": timings, "spent": spent})
