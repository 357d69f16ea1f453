"""How the blob store spells the keys of a put's values, and how a column of keys is recognised
as naming a run of one chunk's rows (so that its values are cut from the chunk in one step).

A value's key is ``{segment}:{offset}:{length}:{row}``: the chunk that holds it and its row
there. A put's column of keys is built by :func:`keys_for`; :func:`whole_chunk` and
:func:`names_rows` tell such a column from any other without building it again.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def chunk_key(prefix: str) -> tuple[int, int, int]:
    """The chunk (segment, offset, length) of a key prefix :meth:`BlobStore.append` returned;
    ValueError if ``prefix`` is not three integers joined by ``:``."""
    segment, offset, length = map(int, prefix.split(":"))
    return segment, offset, length


def whole_chunk(keys: pa.ChunkedArray) -> tuple[int, int, int] | None:
    """The chunk (segment, offset, length) whose rows 0 … n-1 ``keys`` name in that order, as
    :func:`keys_for` builds them for a put's column; else None."""
    if not len(keys) or keys.null_count:
        return None
    prefix, _, row = str(keys[0].as_py()).rpartition(":")
    try:
        ck = chunk_key(prefix)
    except ValueError:
        return None
    if row != "0" or min(ck) < 0:
        return None
    # built from the numbers read: a key spelled any other way differs from it
    return ck if names_rows(keys, ":".join(map(str, ck)), 0) else None


def names_rows(keys: pa.Array | pa.ChunkedArray, prefix: str, first: int) -> bool:
    """Whether ``keys`` (no nulls) are ``prefix:{first} … prefix:{first+n-1}``, as
    :func:`keys_for` spells them: compared as bytes (the keys' offsets and characters against
    those of the expected keys) where they are one string or large_string array, else in Arrow.

    Why: building the expected keys and comparing them in Arrow cost ~0.1 ms a column, several
    times that on a loaded server (each compute call gives up the interpreter lock and waits
    for it again); the first claim of each put paid it for every by-reference column, and a
    ``SELECT *`` for every column it reads."""
    array = keys.chunk(0) if isinstance(keys, pa.ChunkedArray) and keys.num_chunks == 1 \
        else keys
    if isinstance(array, pa.Array) and array.type in _OFFSET_TYPES \
            and first + len(array) <= _NUMBERED_MAX_ROWS:
        _, offsets, data = array.buffers()
        n = len(array)
        if offsets is None or data is None:
            return n == 0
        head = prefix.encode() + b":"
        digits, ends = _numbered(first + n)
        # the offsets of the keys, and what they would be for the expected keys, from 0
        dtype = _OFFSET_TYPES[array.type]
        got = np.frombuffer(offsets, dtype, n + 1, array.offset * dtype.itemsize)
        start = int(got[0])
        lengths = ends[first:first + n + 1] - ends[first] + \
            np.arange(n + 1, dtype=np.int64) * len(head)
        if not np.array_equal(got - start, lengths):
            return False
        joined = head + head.join(digits[first:first + n])
        return data.size >= start + len(joined) and \
            data.slice(start, len(joined)).equals(pa.py_buffer(joined))
    expected = keys_for(prefix, len(keys), first)
    return bool(pc.all(pc.equal(keys.cast(pa.large_string()), expected)).as_py())


_OFFSET_TYPES: dict[pa.DataType, np.dtype] = {pa.string(): np.dtype("<i4"),
                                               pa.large_string(): np.dtype("<i8")}
# Keys past this row number are compared in Arrow: the spelled numbers kept for the bytes check
# stay a few MB.
_NUMBERED_MAX_ROWS = 1 << 16
_NUMBERED: OrderedDict[int, tuple[list[bytes], np.ndarray]] = OrderedDict()
_NUMBERED_LOCK = threading.Lock()


def _numbered(rows: int) -> tuple[list[bytes], np.ndarray]:
    """``0 … rows-1`` spelled in bytes, and the ends of their spellings laid end to end (from
    0; kept for the last few sizes: a put's size repeats)."""
    with _NUMBERED_LOCK:
        hit = _NUMBERED.get(rows)
        if hit is not None:
            _NUMBERED.move_to_end(rows)
    if hit is None:
        digits = [str(i).encode() for i in range(rows)]
        ends = np.concatenate(([0], np.cumsum(np.fromiter(map(len, digits), np.int64, rows))))
        hit = digits, ends
        with _NUMBERED_LOCK:
            _NUMBERED[rows] = hit
            while len(_NUMBERED) > 16:
                _NUMBERED.popitem(last=False)
    return hit


def keys_for(prefix: str, rows: int, first: int = 0) -> pa.Array:
    """``prefix:{first} … prefix:{first+rows-1}`` as an Arrow large_string array (the type of
    the cached ``__ref`` columns), built vectorised."""
    idx = pc.cast(pa.array(np.arange(first, first + rows, dtype=np.int64)), pa.large_string())
    return pc.binary_join_element_wise(pa.scalar(prefix, pa.large_string()), idx,
                                       pa.scalar(":", pa.large_string()))
