"""How a column becomes a blob chunk's bytes, and how a chunk's bytes are checked when read.

A chunk is one column of one put, serialised as one Arrow IPC stream behind a header; the blob
store (:mod:`store.blobs`) appends chunks to segments and hands out keys into them. Apart from the
store so that the format, and the memory a chunk is serialised into, read on their own: nothing
here knows segments, files or the store's state.

A chunk is a 16-byte header, then the IPC stream: ``b"EXB2"``, four zero bytes, the stream's
XXH3-64 (little-endian). Arrow IPC has no checksum of its own; without one, damaged bytes that
still parse (text overwritten by other text) would be served as values. Chunks written before
this header (format 1) start with the stream's CRC-32 instead, directly followed by the stream,
whose first four bytes are IPC's continuation marker ``0xFFFFFFFF``; bytes 4–8 tell the two
formats apart, and both are read. Where a column's type allows reading rows alone, a chunk is
written in format 3 instead (``b"EXB3"``, a row index after the stream; see
:mod:`store.blob_rows`). XXH3 replaced CRC-32 because checksumming was a noticeable share of
the server's CPU for wide rows: XXH3 hashes several times faster than CRC-32, and releases the
GIL while it does.

A chunk serialised for the store is the start of a page-aligned allocation padded with zeros to a
4 KiB multiple, so that a large one can be written by ``O_DIRECT`` from its own memory
(:func:`in_place`); a :class:`ColumnChunk` is a column whose serialisation waits until the store
writes it.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple, Union

import pyarrow as pa
import xxhash

from . import blob_rows

CHUNK_MAGIC = b"EXB2"
HEADER_BYTES = 16                   # magic, 4 zero bytes, XXH3-64: keeps the stream 8-aligned
_IPC_CONTINUATION = b"\xff\xff\xff\xff"  # bytes 4-8 of a format-1 chunk (CRC-32 first)
ALIGN = 4096                        # O_DIRECT's block: chunks are padded to multiples of it
# Chunks from this size on are written by O_DIRECT straight from their own memory, each at an
# aligned offset with up to 4 KiB of zero padding after it. Why: copying a large chunk through
# the staging buffer holds the GIL for the whole copy and made the write markedly longer.
IN_PLACE_MIN_BYTES = 64 << 10
# A column is serialised when written (a ColumnChunk) only from this chunk size on: smaller
# chunks of a stream of batches went faster serialised at prepare, off the writer's path, while
# the writer wrote the batch before (BENCHMARKS.md, issue 30).
DEFER_MIN_BYTES = 4 << 20

# What BlobStore.append takes: the buffer of serialize_chunk_buffer (or its bytes), or a
# ColumnChunk (defined below) to serialise when it is written.
Chunk = Union[bytes, pa.Buffer, "ColumnChunk"]


class _Layout(NamedTuple):
    """Where a column's chunk puts its parts (see :func:`serialize_chunk_buffer`)."""

    stream: int                     # bytes of the IPC stream
    length: int                     # the chunk's bytes: header, stream, index
    schema: bytes | None            # format 3: the schema message the index carries
    block_rows: int
    index_len: int


def _layout(values: pa.Array) -> _Layout:
    """The chunk's sizes, without writing it (the IPC stream counted, not copied)."""
    batch = pa.record_batch([values], names=["v"])
    size = pa.MockOutputStream()                     # counts bytes, copies nothing
    with pa.ipc.new_stream(size, batch.schema) as w:
        w.write_batch(batch)
    stream = size.size()
    if not (blob_rows.supported(values.type) and len(values) > 0):
        return _Layout(stream, HEADER_BYTES + stream, None, 0, 0)
    schema = batch.schema.serialize().to_pybytes()
    block_rows = blob_rows.block_rows_for(values)
    index_len = blob_rows.index_size(len(schema), len(values.buffers()),
                                     -(-len(values) // block_rows))
    return _Layout(stream, HEADER_BYTES + stream + index_len, schema, block_rows, index_len)


def _write_chunk(values: pa.Array, layout: _Layout, into: pa.Buffer) -> None:
    """Write the chunk of ``values`` at the start of the mutable buffer ``into``, then zeros up
    to the next 4 KiB boundary (``into`` holds at least that much)."""
    length = layout.length
    batch = pa.record_batch([values], names=["v"])
    sink = pa.FixedSizeBufferWriter(into)
    sink.write(bytes(HEADER_BYTES))
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    if layout.schema is not None:
        chunk = into.slice(0, length)
        column = pa.ipc.open_stream(chunk.slice(HEADER_BYTES, layout.stream)) \
            .read_next_batch()[0]
        index = blob_rows.build_index(column, chunk, layout.schema, layout.block_rows)
        assert len(index) == layout.index_len
        sink.write(index)
        head = blob_rows.INDEX_MAGIC + len(index).to_bytes(4, "little") + \
            xxhash.xxh3_64_intdigest(index).to_bytes(8, "little")
    else:
        digest = xxhash.xxh3_64_intdigest(memoryview(into)[HEADER_BYTES:length])
        head = CHUNK_MAGIC + bytes(4) + digest.to_bytes(8, "little")
    sink.write(bytes(align_up(length) - length))
    pa.FixedSizeBufferWriter(into).write(head)


def serialize_chunk_buffer(values: pa.Array) -> pa.Buffer:
    """One column's large values as a chunk, serialised on the caller's thread into one Arrow
    buffer written once: format 3 (header, IPC stream, row index; see :mod:`store.blob_rows`)
    where the type allows reading rows alone, else format 2 (header, IPC stream).

    The buffer is the start of an allocation padded with zeros to a 4 KiB multiple, so that a
    large chunk can be written by O_DIRECT in place (see :func:`in_place`)."""
    return ColumnChunk(values).serialized()


def column_chunk(values: pa.Array, *, owned: bool) -> Chunk:
    """``values`` as a chunk to append: a :class:`ColumnChunk`, serialised when it is written,
    where nothing can change the values meanwhile (``owned``: arrays only the store holds, or
    made of :func:`read_only` ones) and the chunk is large (:data:`DEFER_MIN_BYTES`); else
    serialised now (a caller's arrays may lie over memory it changes later, a numpy array's)."""
    if owned:
        chunk = ColumnChunk(values)
        if len(chunk) >= DEFER_MIN_BYTES:
            return chunk
    return serialize_chunk_buffer(values)


def read_only(values: pa.Array | pa.ChunkedArray) -> bool:
    """Whether every buffer of ``values`` is a slice of a read-only buffer, as those read from an
    Arrow IPC stream are (a Flight batch): no one can change them."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    return all(buf is None or (buf.parent is not None and not buf.parent.is_mutable)
               for chunk in chunks for buf in chunk.buffers())


class ColumnChunk:
    """A column to be stored as one chunk, serialised only when the blob store writes it: into
    a buffer the store reuses from one write to the next (O_DIRECT), or, elsewhere, into memory
    of its own (:func:`serialize_chunk_buffer`). The chunk is the same either way; its length
    is known at once (keys are made before the write).

    Why: serialising every put's chunks into new memory made the kernel fault in and zero that
    memory first, which cost a 40 MiB put more than the copy itself; the values are kept in
    memory for reads (see :meth:`store.blobs.BlobStore._keep_recent`) as they came, not as a
    copy."""

    __slots__ = ("values", "layout")

    def __init__(self, values: pa.Array) -> None:
        self.values = values
        self.layout = _layout(values)

    def __len__(self) -> int:
        return self.layout.length

    def write_into(self, into: pa.Buffer) -> int:
        """Serialise into ``into`` (mutable, at least :meth:`padded` bytes); return
        :meth:`padded`."""
        _write_chunk(self.values, self.layout, into)
        return self.padded()

    def padded(self) -> int:
        return align_up(self.layout.length)

    def serialized(self) -> pa.Buffer:
        """The chunk in memory of its own."""
        padded = pa.allocate_buffer(self.padded())  # slices are read-only: write this one
        _write_chunk(self.values, self.layout, padded)
        return padded.slice(0, self.layout.length)


def chunk_body(data: bytes) -> memoryview | None:
    """The IPC stream of a chunk whose checksum matches, else None (either format)."""
    head = bytes(data[:HEADER_BYTES])
    if head[4:8] == _IPC_CONTINUATION:               # format 1: CRC-32, then the stream
        body = memoryview(data)[4:]
        return body if zlib.crc32(body).to_bytes(4, "little") == head[:4] else None
    if head[:8] == CHUNK_MAGIC + bytes(4) and len(head) == HEADER_BYTES:
        body = memoryview(data)[HEADER_BYTES:]
        return body if xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") == head[8:] \
            else None
    return None


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def in_place(chunk: Chunk) -> memoryview | None:
    """The chunk and its padding as one O_DIRECT-writable view, if it can be written in place:
    a large chunk from :func:`serialize_chunk_buffer`, i.e. a slice at the start of a
    page-aligned buffer that reaches (zero-padded) to the next 4 KiB boundary."""
    if not isinstance(chunk, pa.Buffer) or len(chunk) < IN_PLACE_MIN_BYTES:
        return None
    whole = chunk.parent
    end = align_up(len(chunk))
    if whole is None or whole.address != chunk.address or chunk.address % ALIGN \
            or whole.size < end:
        return None
    return memoryview(whole)[:end]


def in_memory(chunk: Chunk) -> bytes | pa.Buffer:
    """A chunk's bytes (a ColumnChunk serialised)."""
    return chunk.serialized() if isinstance(chunk, ColumnChunk) else chunk
