"""Row-range reads of blob chunks: a claim of a few rows reads and checks only their bytes.

Why: a chunk holds one column of a whole put (a 1,024-row put of a column of 4 KB values makes a
4 MB chunk). Reading a chunk whole, checksumming it and taking a few rows out of it is what
reading by-reference values cost before this format: a claim of 16 rows read its put's whole
columns.

A format-3 chunk is the 16-byte header, the column's Arrow IPC stream (unchanged), then an
*index*: ``b"EXB3"``, the index's length (u32), the index's XXH3-64 (u64), all little-endian::

    u32 rows, u32 block_rows, u32 buffers, u32 schema_bytes
    the column's schema (an IPC schema message), zero-padded to 8 bytes
    per buffer of the column, in IPC order: u64 offset in the chunk, u64 length (0: absent)
    per block of ``block_rows`` rows: u64 XXH3-64 of the block's bytes

A block's bytes are, buffer by buffer in IPC order, the byte ranges its rows occupy (a validity
or boolean bitmap's bytes, offsets ``[a, b]``, the values those offsets delimit, recursively for
nested types); ``block_rows`` is a multiple of 8 so that bitmaps split on byte boundaries, and a
list's child range starts at a multiple of 8 elements for the same reason (up to 7 elements
before it belong to the block too). A read fetches the blocks that hold the rows asked for,
checks their hashes and builds the arrays over the bytes it read (zero-copy slices of them), so
it reads at most one block more on either side than the rows it returns, never a whole column.

Types the layout handles: fixed-width primitives and booleans, (large) strings and binaries,
(large) lists, fixed-size lists and structs of those (the store's tensors are structs). Other
types are written in format 2 and read whole.
"""
from __future__ import annotations

import struct
from typing import Callable, NamedTuple

import numpy as np
import pyarrow as pa
import xxhash

INDEX_MAGIC = b"EXB3"
HEADER_BYTES = 16
BLOCK_BYTES = 64 << 10              # the bytes a block aims at (at least 8 rows)
_COUNTS = struct.Struct("<4I")

#: ``fetch(buffer, start, end)``: bytes ``[start, end)`` of the column's buffer number
#: ``buffer`` (IPC order), as an Arrow buffer.
Fetch = Callable[[int, int, int], pa.Buffer]


class ChunkIndex(NamedTuple):
    """A format-3 chunk's index, parsed."""

    type: pa.DataType
    rows: int
    block_rows: int
    buffers: list[tuple[int, int]]     # (offset in the chunk, length); length 0: absent
    hashes: np.ndarray                 # uint64 per block

    def blocks(self, first_row: int, end_row: int) -> range:
        """The blocks holding rows ``[first_row, end_row)``."""
        return range(first_row // self.block_rows, (end_row - 1) // self.block_rows + 1)

    def block_range(self, block: int) -> tuple[int, int]:
        start = block * self.block_rows
        return start, min(start + self.block_rows, self.rows)


def supported(t: pa.DataType) -> bool:
    """Whether :func:`read_block` can cut rows of type ``t`` out of their buffers."""
    if _is_var_width(t):
        return True
    if pa.types.is_struct(t):
        return all(supported(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return supported(t.value_type)
    try:
        return t.bit_width > 0 and not pa.types.is_dictionary(t)
    except ValueError:
        return False


def _is_var_width(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
            or pa.types.is_large_binary(t))


def _offset_dtype(t: pa.DataType) -> np.dtype:
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or \
        pa.types.is_large_list(t)
    return np.dtype("<i8") if large else np.dtype("<i4")


def block_rows_for(values: pa.Array) -> int:
    """Rows per block: about :data:`BLOCK_BYTES`, a multiple of 8, at least 8."""
    n = max(len(values), 1)
    per_row = max(values.nbytes // n, 1)
    rows = max(8, BLOCK_BYTES // per_row // 8 * 8)
    return min(rows, -(-n // 8) * 8)


def index_size(schema_bytes: int, buffers: int, blocks: int) -> int:
    return _COUNTS.size + _pad8(schema_bytes) + 16 * buffers + 8 * blocks


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def build_index(column: pa.Array, chunk: pa.Buffer, schema: bytes, block_rows: int) -> bytes:
    """The index of ``column`` as written in ``chunk`` (read back from it zero-copy, so that its
    buffers' addresses give their offsets in the chunk)."""
    base = chunk.address
    buffers = [(0, 0) if b is None or b.size == 0 else (b.address - base, b.size)
               for b in column.buffers()]
    if any(o < 0 or o + n > chunk.size for o, n in buffers):
        raise ValueError("the column's buffers do not lie in its chunk")
    whole = np.frombuffer(chunk, np.uint8)
    views = [whole[o:o + n] for o, n in buffers]
    rows = len(column)
    starts = np.arange(0, rows, block_rows, dtype=np.int64)
    ends = np.minimum(starts + block_rows, rows)
    spans: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    _spans(column.type, starts, ends, _present(buffers), iter(range(len(buffers))), views,
           spans)
    hashes = np.empty(len(starts), np.uint64)
    for block in range(len(starts)):
        hasher = xxhash.xxh3_64()
        for view, lo, hi in spans:
            hasher.update(view[lo[block]:hi[block]])  # type: ignore[arg-type]
        hashes[block] = hasher.intdigest()
    counts = _COUNTS.pack(rows, block_rows, len(buffers), len(schema))
    table = np.array(buffers, dtype="<u8").reshape(-1)
    return b"".join([counts, schema, bytes(_pad8(len(schema)) - len(schema)),
                     table.tobytes(), hashes.astype("<u8").tobytes()])


def _spans(t: pa.DataType, a: np.ndarray, b: np.ndarray, present: list[bool], counter,
           views: list[np.ndarray], out: list) -> None:
    """What :func:`_read` fetches for rows ``[a, b)``, for every block at once: ``(buffer's
    bytes, start, end)`` per buffer, starts and ends per block, in the order it fetches them."""
    a0 = a - a % 8
    vi = next(counter)
    if present[vi]:
        out.append((views[vi], a0 // 8, (b + 7) // 8))
    if pa.types.is_boolean(t):
        out.append((views[next(counter)], a0 // 8, (b + 7) // 8))
    elif _is_var_width(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        dtype = _offset_dtype(t)
        oi = next(counter)
        out.append((views[oi], a0 * dtype.itemsize, (b + 1) * dtype.itemsize))
        offsets = views[oi].view(dtype)
        lo, hi = offsets[a0].astype(np.int64), offsets[b].astype(np.int64)
        if _is_var_width(t):
            out.append((views[next(counter)], lo, hi))
        else:
            _spans(t.value_type, lo, hi, present, counter, views, out)
    elif pa.types.is_fixed_size_list(t):
        _spans(t.value_type, a0 * t.list_size, b * t.list_size, present, counter, views, out)
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            _spans(t.field(i).type, a0, b, present, counter, views, out)
    else:
        w = t.bit_width // 8
        out.append((views[next(counter)], a0 * w, b * w))


def parse_index(data: bytes) -> ChunkIndex:
    """The index's fields (its hash was checked by the caller)."""
    rows, block_rows, nbuf, nschema = _COUNTS.unpack_from(data, 0)
    at = _COUNTS.size
    schema = pa.ipc.read_schema(pa.py_buffer(data[at:at + nschema]))
    at += _pad8(nschema)
    table = np.frombuffer(data, "<u8", 2 * nbuf, at).reshape(-1, 2)
    at += 16 * nbuf
    blocks = -(-rows // block_rows) if block_rows else 0
    if block_rows <= 0 or block_rows % 8 or at + 8 * blocks != len(data):
        raise ValueError(f"index of {len(data)} bytes does not match its counts")
    hashes = np.frombuffer(data, "<u8", blocks, at)
    return ChunkIndex(schema.field(0).type, rows, block_rows,
                      [(int(o), int(n)) for o, n in table], hashes)


def _present(buffers: list[tuple[int, int]]) -> list[bool]:
    return [n > 0 for _, n in buffers]


def read_block(t: pa.DataType, start: int, end: int, present: list[bool],
               fetch: Fetch, build: bool = True) -> tuple[pa.Array | None, int]:
    """Rows ``[start, end)`` (``start`` a multiple of 8) built over the bytes ``fetch`` gives
    (None unless ``build``), and the XXH3-64 of those bytes in the order they were fetched."""
    hasher = xxhash.xxh3_64()
    counter = iter(range(len(present)))

    def take(i: int, lo: int, hi: int) -> pa.Buffer:
        buf = fetch(i, lo, hi)
        if buf.size != hi - lo:
            raise ValueError(f"buffer {i} bytes [{lo}, {hi}) are cut short ({buf.size})")
        hasher.update(memoryview(buf))
        return buf

    array = _read(t, start, end, present, counter, take, build)
    return array, hasher.intdigest()


class _Node(NamedTuple):
    """How :func:`_read` cuts one level of a type: decided once per type, not per read."""

    type: pa.DataType
    kind: str                       # "bool", "var", "list", "fixed_list", "struct", "fixed"
    width: int                      # bytes per offset ("var", "list") or value ("fixed")
    dtype: np.dtype | None          # the offsets' dtype ("var", "list")
    children: tuple["_Node", ...]
    size: int                       # list_size ("fixed_list")


_PLANS: dict[pa.DataType, _Node] = {}


def _plan(t: pa.DataType) -> _Node:
    node = _PLANS.get(t)
    if node is None:
        node = _PLANS[t] = _make_plan(t)
    return node


def _make_plan(t: pa.DataType) -> _Node:
    if pa.types.is_boolean(t):
        return _Node(t, "bool", 0, None, (), 0)
    if _is_var_width(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        dtype = _offset_dtype(t)
        if _is_var_width(t):
            return _Node(t, "var", dtype.itemsize, dtype, (), 0)
        return _Node(t, "list", dtype.itemsize, dtype, (_make_plan(t.value_type),), 0)
    if pa.types.is_fixed_size_list(t):
        return _Node(t, "fixed_list", 0, None, (_make_plan(t.value_type),), t.list_size)
    if pa.types.is_struct(t):
        return _Node(t, "struct", 0, None,
                     tuple(_make_plan(t.field(i).type) for i in range(t.num_fields)), 0)
    return _Node(t, "fixed", t.bit_width // 8, None, (), 0)


def _read(t: pa.DataType | _Node, a: int, b: int, present: list[bool], counter, take: Fetch,
          build: bool = True) -> pa.Array | None:
    """Rows ``[a, b)`` of type ``t``: read from ``a0 = a - a % 8`` (bitmaps split on bytes),
    returned as a slice from ``a``."""
    node = t if isinstance(t, _Node) else _plan(t)
    kind = node.kind
    a0 = a - a % 8
    n = b - a0
    vi = next(counter)
    validity = take(vi, a0 // 8, (b + 7) // 8) if present[vi] else None
    out: pa.Array | None = None
    if kind == "fixed":
        w = node.width
        data = take(next(counter), a0 * w, b * w)
        if build:
            out = pa.Array.from_buffers(node.type, n, [validity, data])
    elif kind == "var" or kind == "list":
        w = node.width
        offsets = np.frombuffer(take(next(counter), a0 * w, (b + 1) * w), node.dtype)
        lo, hi = int(offsets[0]), int(offsets[-1])
        if lo > hi or (n > 1 and (offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"offsets of rows [{a0}, {b}) are not ascending")
        if kind == "var":
            data = take(next(counter), lo, hi)
            if build:
                rebased = pa.py_buffer(offsets - lo) if lo else pa.py_buffer(offsets)
                out = pa.Array.from_buffers(node.type, n, [validity, rebased, data])
        else:
            child = _read(node.children[0], lo, hi, present, counter, take, build)
            if build:
                out = pa.Array.from_buffers(node.type, n,
                                            [validity, pa.py_buffer(offsets - lo)],
                                            children=[child])
    elif kind == "bool":
        data = take(next(counter), a0 // 8, (b + 7) // 8)
        if build:
            out = pa.Array.from_buffers(node.type, n, [validity, data])
    elif kind == "fixed_list":
        k = node.size
        child = _read(node.children[0], a0 * k, b * k, present, counter, take, build)
        if build:
            out = pa.Array.from_buffers(node.type, n, [validity], children=[child])
    else:
        children = [_read(c, a0, b, present, counter, take, build) for c in node.children]
        if build:
            out = pa.Array.from_buffers(node.type, n, [validity], children=children)
    if out is None:
        return None
    return out.slice(a - a0) if a != a0 else out


def read_rows(index: ChunkIndex, first: int, end: int, fetch: Fetch) -> pa.Array:
    """Rows ``[first, end)`` of an indexed chunk, their blocks' hashes checked.

    The blocks holding the rows are read in one pass (one ``fetch`` per buffer), then each
    block's hash is computed over its part of what was read; the rows are a zero-copy slice.

    Raises:
        ValueError: a block's bytes do not match its hash, or point outside their buffers.
    """
    blocks = index.blocks(first, end)
    start = blocks.start * index.block_rows
    stop = min(blocks.stop * index.block_rows, index.rows)
    present = _present(index.buffers)
    got: dict[int, tuple[int, pa.Buffer]] = {}

    def from_file(i: int, lo: int, hi: int) -> pa.Buffer:
        if hi > index.buffers[i][1]:
            raise ValueError(f"bytes [{lo}, {hi}) lie outside buffer {i} "
                             f"({index.buffers[i][1]} bytes)")
        buf = fetch(i, lo, hi)
        got[i] = (lo, buf)
        return buf

    def from_memory(i: int, lo: int, hi: int) -> pa.Buffer:
        at, buf = got[i]
        if lo < at or hi - at > buf.size:
            raise ValueError(f"block bytes [{lo}, {hi}) of buffer {i} were not read")
        return buf.slice(lo - at, hi - lo)

    run, digest = read_block(index.type, start, stop, present, from_file)
    assert run is not None
    if len(blocks) == 1:
        if digest != int(index.hashes[blocks.start]):
            raise ValueError(f"block {blocks.start} does not match its checksum")
    else:
        for block in blocks:
            lo, hi = index.block_range(block)
            if read_block(index.type, lo, hi, present, from_memory, build=False)[1] != \
                    int(index.hashes[block]):
                raise ValueError(f"block {block} does not match its checksum")
    return run.slice(first - start, end - first)
