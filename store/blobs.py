"""The blob store: complex values stored by reference, in append-only Arrow IPC segments.

Why: DuckDB ingests wide rows by value at ~18 MB/s on these machines, while appending Arrow IPC to
a file runs at ~900 MB/s. So the writer serialises each ref column of a put as one Arrow IPC
stream (a *chunk*), appends the chunks of a whole group commit to the current segment, fsyncs
once, and only then commits the keys to DuckDB. A key is ``"{segment}:{offset}:{length}:{row}"``.

Segments live in a directory beside the database by default; any ``pyarrow.fs.FileSystem`` (S3,
GCS, a sub-tree) can be given instead, in which case each group commit writes one immutable
segment object, since object stores cannot append.
"""
from __future__ import annotations

import os
import re
import threading
import zlib
from collections import OrderedDict
from typing import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from .errors import StorageError

SEGMENT_BYTES = 256 << 20
_SEGMENT_NAME = re.compile(r"^seg-(\d{8})\.arrow$")


CHECKSUM_BYTES = 4


def serialize_chunk_buffer(values: pa.Array) -> pa.Buffer:
    """One column's large values as a CRC-32 followed by an Arrow IPC stream (on the caller's
    thread), in one Arrow buffer written once. Arrow IPC has no checksum of its own; without
    one, damaged bytes that still parse (text overwritten by other text) would be served as
    values."""
    batch = pa.record_batch([values], names=["v"])
    size = pa.MockOutputStream()                     # counts bytes, copies nothing
    with pa.ipc.new_stream(size, batch.schema) as w:
        w.write_batch(batch)
    buf = pa.allocate_buffer(CHECKSUM_BYTES + size.size())
    sink = pa.FixedSizeBufferWriter(buf)
    sink.write(bytes(CHECKSUM_BYTES))
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    crc = zlib.crc32(memoryview(buf)[CHECKSUM_BYTES:])
    pa.FixedSizeBufferWriter(buf).write(crc.to_bytes(CHECKSUM_BYTES, "little"))
    return buf


def serialize_chunk(values: pa.Array) -> bytes:
    """:func:`serialize_chunk_buffer` as ``bytes`` (one pass: the IPC stream is written once,
    then joined to its CRC)."""
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([values], names=["v"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    body = sink.getvalue()
    return b"".join((zlib.crc32(body).to_bytes(CHECKSUM_BYTES, "little"), body))


class BlobStore:
    """Append-only segments of serialised chunks.

    Only the store's writer thread calls :meth:`append` and :meth:`sync`; any thread may read.
    """

    def __init__(self, root: str, filesystem: pafs.FileSystem | None = None) -> None:
        self.root = root.rstrip("/")
        self._fs = filesystem
        self._local = filesystem is None or isinstance(filesystem, pafs.LocalFileSystem)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._cache: OrderedDict[tuple[int, int, int], pa.Array] = OrderedDict()
        self._cache_lock = threading.Lock()
        try:
            if self._local:
                os.makedirs(self.root, exist_ok=True)
            else:
                assert self._fs is not None
                self._fs.create_dir(self.root, recursive=True)
            segments = self.segments()
        except OSError as e:
            raise StorageError(f"cannot use blob directory {self.root!r}: {e}") from e
        self._segment = max(segments) if segments else 0
        self._size = self._segment_size(self._segment) if segments else 0
        if not self._local or self._size >= SEGMENT_BYTES:
            self._segment += 1
            self._size = 0

    # -- paths ---------------------------------------------------------------------------------
    def _path(self, segment: int) -> str:
        return f"{self.root}/seg-{segment:08d}.arrow"

    def segments(self) -> list[int]:
        if self._local:
            names = os.listdir(self.root)
        else:
            assert self._fs is not None
            infos = self._fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
            names = [i.base_name for i in infos]
        return sorted(int(m.group(1)) for n in names if (m := _SEGMENT_NAME.match(n)))

    def _segment_size(self, segment: int) -> int:
        if self._local:
            try:
                return os.path.getsize(self._path(segment))
            except FileNotFoundError:
                return 0
        assert self._fs is not None
        return self._fs.get_file_info(self._path(segment)).size or 0

    # -- writing (writer thread) -----------------------------------------------------------------
    def append(self, chunk: bytes) -> str:
        """Stage a chunk for the next :meth:`sync`; return its key prefix (add ``:{row}``)."""
        if self._local and self._size + self._pending_bytes > SEGMENT_BYTES and not self._pending:
            self._segment += 1
            self._size = 0
        key = f"{self._segment}:{self._size + self._pending_bytes}:{len(chunk)}"
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        return key

    def sync(self) -> None:
        """Write and fsync the staged chunks. On failure nothing staged is kept."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        path = self._path(self._segment)
        try:
            if self._local:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    try:
                        _write_all(fd, data)
                        os.fsync(fd)
                    except OSError:
                        # A torn append would leave garbage that later offsets skip over; cut it.
                        os.ftruncate(fd, self._size)
                        raise
                finally:
                    os.close(fd)
                self._size += len(data)
            else:
                assert self._fs is not None
                with self._fs.open_output_stream(path) as out:
                    out.write(data)
                self._segment += 1
                self._size = 0
        except OSError as e:
            raise StorageError(f"cannot write blob segment {path!r}: {e}") from e

    def roll(self) -> None:
        """Start a new segment, so that the one written so far can be collected when no row
        references it any more (GC never deletes the segment being written)."""
        if self._local and self._size > 0 and not self._pending:
            self._segment += 1
            self._size = 0

    def rollback(self) -> None:
        """Forget staged chunks (their group commit failed before sync)."""
        self._pending.clear()
        self._pending_bytes = 0

    # -- reading -----------------------------------------------------------------------------
    def _chunk(self, segment: int, offset: int, length: int) -> pa.Array:
        ck = (segment, offset, length)
        with self._cache_lock:
            hit = self._cache.get(ck)
            if hit is not None:
                self._cache.move_to_end(ck)
                return hit
        path = self._path(segment)
        try:
            if self._local:
                with open(path, "rb") as f:
                    data = os.pread(f.fileno(), length, offset)
            else:
                assert self._fs is not None
                with self._fs.open_input_file(path) as f:
                    data = f.read_at(length, offset)
        except (OSError, pa.ArrowException) as e:
            raise StorageError(f"blob segment {path!r} cannot be read: {e}") from e
        if len(data) != length:
            raise StorageError(f"blob chunk {segment}:{offset}:{length} is truncated in {path!r} "
                               f"({len(data)} of {length} bytes)")
        body = memoryview(data)[CHECKSUM_BYTES:]
        if zlib.crc32(body).to_bytes(CHECKSUM_BYTES, "little") != bytes(data[:CHECKSUM_BYTES]):
            raise StorageError(f"blob chunk {segment}:{offset}:{length} in {path!r} is corrupt: "
                               "its checksum does not match its bytes")
        try:
            values = pa.ipc.open_stream(pa.py_buffer(body)).read_all().column(0).combine_chunks()
            # IPC has no checksums: damaged bytes inside a chunk would otherwise be served as
            # values (invalid UTF-8, offsets past the end). Full validation catches those.
            values.validate(full=True)
        except pa.ArrowException as e:
            raise StorageError(f"blob chunk {segment}:{offset}:{length} in {path!r} is corrupt: "
                               f"{e}") from e
        with self._cache_lock:
            self._cache[ck] = values
            while len(self._cache) > 64:
                self._cache.popitem(last=False)
        return values

    def resolve(self, keys: Sequence[str | None], value_type: pa.DataType) -> pa.Array:
        """The values for ``keys`` (None stays null), in order."""
        by_chunk: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for pos, key in enumerate(keys):
            if key is None:
                continue
            try:
                seg, off, length, row = (int(p) for p in key.split(":"))
            except ValueError:
                raise StorageError(f"blob key {key!r} is malformed") from None
            by_chunk.setdefault((seg, off, length), []).append((pos, row))
        if not by_chunk:
            return pa.nulls(len(keys), value_type)
        positions: list[int] = []
        pieces: list[pa.Array] = []
        for ck, items in by_chunk.items():
            chunk = self._chunk(*ck)
            rows = pa.array([r for _, r in items], pa.int64())
            if len(items) and max(r for _, r in items) >= len(chunk):
                raise StorageError(f"blob key row out of range in chunk {ck}")
            pieces.append(chunk.take(rows).cast(value_type))
            positions.extend(p for p, _ in items)
        values = pa.concat_arrays(pieces)
        # Scatter back into key order: nulls where the key was None.
        order = [-1] * len(keys)
        for i, p in enumerate(positions):
            order[p] = i
        return values.take(pa.array([o if o >= 0 else None for o in order], pa.int64()))

    # -- garbage collection ----------------------------------------------------------------------
    def collect(self, live_segments: Iterable[int]) -> dict[str, int]:
        """Delete whole segments that no row references (never the one being written)."""
        live = set(live_segments) | {self._segment}
        removed = freed = 0
        for seg in self.segments():
            if seg in live:
                continue
            size = self._segment_size(seg)
            try:
                if self._local:
                    os.remove(self._path(seg))
                else:
                    assert self._fs is not None
                    self._fs.delete_file(self._path(seg))
            except OSError as e:
                raise StorageError(f"cannot delete blob segment {self._path(seg)!r}: {e}") from e
            removed += 1
            freed += size
        with self._cache_lock:
            self._cache.clear()
        return {"segments_removed": removed, "bytes_freed": freed}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def keys_for(prefix: str, rows: int) -> pa.Array:
    """``prefix:0 … prefix:{rows-1}`` as an Arrow string array, built vectorised."""
    idx = pc.cast(pa.array(range(rows), pa.int64()), pa.string())
    return pc.binary_join_element_wise(pa.array([prefix] * rows, pa.string()), idx, ":")
