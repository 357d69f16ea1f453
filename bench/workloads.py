"""The two row shapes every benchmark uses, built fast and deterministically.

* narrow: ``sample_id``, ``reward`` float64, three bools, a 32-byte ``tag`` string.
* wide: ``sample_id``, ``prompt`` (1 KB) + ``response`` (3 KB) text, 1,024 int32 ``token_ids``,
  1,024 float32 ``logprobs`` (≈ 12.3 KB per row in Arrow).

Sample IDs are ``{input_id}_{turn}_{trajectory_id}`` with ``GROUP`` trajectories per input, so
group-aware claims (``group_by="input_id"``) find complete groups. "MB" is 1e6 bytes of Arrow
buffers (``Table.nbytes``), the same count for every system compared.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

BATCH_ROWS = 4096
GROUP = 8  # trajectories per input_id
PROMPT_BYTES = 1024
RESPONSE_BYTES = 3072
TOKENS = 1024

NARROW_COLUMNS = {"reward": "float64", "done": "bool", "truncated": "bool", "correct": "bool",
                  "tag": "string"}
WIDE_COLUMNS = {"prompt": "string", "response": "string", "token_ids": "list<int32>",
                "logprobs": "list<float32>"}
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,0123456789",
                          dtype=np.uint8)


def sample_ids(n: int, start: int = 0, turn: int = 0, group: int = GROUP) -> pa.Array:
    idx = np.arange(start, start + n)
    ids = [f"{i // group}_{turn}_{i % group}" for i in idx.tolist()]
    return pa.array(ids, pa.string())


def _text(n: int, width: int, rng: np.random.Generator) -> pa.Array:
    # random printable text: DuckDB cannot compress it much, like real model output
    data = _ALPHABET[rng.integers(0, len(_ALPHABET), n * width, dtype=np.uint8)]
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data.tobytes()))


def _lists(values: np.ndarray, n: int, width: int, typ: pa.DataType) -> pa.Array:
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values, typ))


def narrow_table(n: int, start: int = 0, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed + start)
    tags = _text(n, 32, rng)
    return pa.table({
        "sample_id": sample_ids(n, start),
        "reward": pa.array(rng.random(n)),
        "done": pa.array(rng.random(n) < 0.9),
        "truncated": pa.array(rng.random(n) < 0.05),
        "correct": pa.array(rng.random(n) < 0.5),
        "tag": tags,
    })


def wide_table(n: int, start: int = 0, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed + start + 1)
    return pa.table({
        "sample_id": sample_ids(n, start),
        "prompt": _text(n, PROMPT_BYTES, rng),
        "response": _text(n, RESPONSE_BYTES, rng),
        "token_ids": _lists(rng.integers(0, 150_000, n * TOKENS, dtype=np.int32), n, TOKENS,
                            pa.int32()),
        "logprobs": _lists(-rng.random(n * TOKENS, dtype=np.float32) * 5, n, TOKENS, pa.float32()),
    })


def rebatch(table: pa.Table, rows: int = BATCH_ROWS) -> pa.Table:
    """The same table as chunks of ``rows`` rows (what a bulk producer sends)."""
    return pa.Table.from_batches(table.combine_chunks().to_batches(max_chunksize=rows))


def mb(data: pa.Table | pa.RecordBatch) -> float:
    return data.nbytes / 1e6
