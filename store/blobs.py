"""The blob store: complex values stored by reference, in append-only Arrow IPC segments.

Why: DuckDB ingests wide rows by value at a small fraction of the rate at which a file takes
appended Arrow IPC (BENCHMARKS.md measures DuckDB's wide insert by value and the disk's writes).
So the writer serialises each ref column of a put as one Arrow IPC stream (a *chunk*), appends
the chunks of a whole group commit to the current segment, fsyncs once, and only then commits
the keys to DuckDB. A key is ``"{segment}:{offset}:{length}:{row}"``.

Segments live in a directory beside the database by default; any ``pyarrow.fs.FileSystem`` (S3,
GCS, a sub-tree) can be given instead, in which case each group commit writes one immutable
segment object, since object stores cannot append.

Local segments are written with ``O_DIRECT`` where the filesystem accepts it (page-cache
writeback, not the device, limits buffered ``write`` + ``fsync``): each group commit then starts
at a 4 KiB-aligned offset and its tail is padded with zeros to a 4 KiB boundary. Large chunks
(:data:`~store.blob_chunks.IN_PLACE_MIN_BYTES` and up) are written from page-aligned memory with
zeroed padding, each at a 4 KiB-aligned offset of its own: a
:class:`~store.blob_chunks.ColumnChunk` (a column of 4 MiB and more that arrived in read-only
buffers) is serialised only then, into one of two buffers kept for that, while the one before it
is written from the other; a chunk serialised by the caller
(:func:`~store.blob_chunks.serialize_chunk_buffer`) is written from its own memory. Smaller ones
are copied back to back through a page-aligned staging buffer. Keys carry offsets, so readers
never see the padding (nothing reads a segment sequentially); segments written before, or by the
buffered fallback (filesystems that refuse ``O_DIRECT``, such as tmpfs on older kernels, or
``EXPSTORE_BLOB_DIRECT_IO=0``), have no padding; all read the same way. A write is still followed
by ``fsync`` before any key is committed.

What a chunk's bytes are (the format, its checksum, the memory it is serialised into) is
:mod:`store.blob_chunks`; how a group's staged chunks are written into a local segment (through
the staging buffer and the reused buffers, ``O_DIRECT`` or buffered, then ``fsync``) is
:mod:`store.blob_writes`; how bytes reach a segment file and are read back at the operating
system's level (``O_DIRECT``, ``pwrite``, open descriptors) is :mod:`store.blob_files`; this
module decides where each chunk goes, when it is durable, and what stays in memory for reads.
"""
from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from typing import Callable, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from . import blob_rows
from .blob_chunks import (HEADER_BYTES, IN_PLACE_MIN_BYTES, Chunk, ColumnChunk,
                          align_up, chunk_body, in_memory, in_place)
from .blob_files import DIRECT_IO, OpenSegment, Staged, probe_direct
from .blob_keys import chunk_key, names_rows, whole_chunk
from .blob_writes import SegmentWriter
from .row_cut import RowCut, cut
from .errors import StorageError
from .settings import StoreSettings
from .table_memo import TableMemo
from .types import one_array

_DEFAULTS = StoreSettings()
_SEGMENT_NAME = re.compile(r"^seg-(\d{8})\.arrow$")

INDEX_CACHE = 4096                  # format-3 chunk indexes kept parsed (a few KB each)
OPEN_SEGMENTS = 16                  # segment files kept open for reading


class BlobStore:
    """Append-only segments of serialised chunks.

    Only the store's writer thread calls :meth:`append` and :meth:`sync`; any thread may read.
    """

    def __init__(self, root: str, filesystem: pafs.FileSystem | None = None,
                 recent_bytes: int = _DEFAULTS.blob_recent_bytes,
                 segment_bytes: int = _DEFAULTS.blob_segment_bytes,
                 direct_io: bool | None = None) -> None:
        """``direct_io``: write segments with O_DIRECT where the filesystem takes it (None: yes,
        unless the environment says ``EXPSTORE_BLOB_DIRECT_IO=0``)."""
        self.root = root.rstrip("/")
        self._fs = filesystem
        self._local = filesystem is None or isinstance(filesystem, pafs.LocalFileSystem)
        self._pending: list[Staged] = []
        self._start = 0                  # where the staged chunks go in the current segment
        self._end = 0                    # where the next staged chunk goes
        self._cache: OrderedDict[tuple[int, int, int], pa.Array] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._indexes: OrderedDict[tuple[int, int, int], blob_rows.ChunkIndex | None] = \
            OrderedDict()
        self._fds: OrderedDict[int, OpenSegment] = OrderedDict()
        self.recent_bytes = recent_bytes
        self.segment_bytes = segment_bytes
        # (segment, offset, length) -> (the chunk's values over its own buffer, its size)
        self._recent: OrderedDict[tuple[int, int, int], tuple[pa.Array, int]] = OrderedDict()
        self._recent_held = 0
        # by cached put's table: by key column, the chunk whose rows 0 … n-1 that column names
        # in order, or None (see put_columns)
        self._whole: TableMemo[dict[int, tuple[int, int, int] | None]] = TableMemo()
        try:
            if self._local:
                os.makedirs(self.root, exist_ok=True)
            else:
                assert self._fs is not None
                self._fs.create_dir(self.root, recursive=True)
            segments = self.segments()
        except OSError as e:
            raise StorageError(f"cannot use blob directory {self.root!r}: {e}") from e
        # Decided once per store; a write refused later (EINVAL) turns it off for good.
        self._writes = SegmentWriter(self._local and probe_direct(
            self.root, DIRECT_IO if direct_io is None else direct_io))
        self._segment = max(segments) if segments else 0
        self._size = self._segment_size(self._segment) if segments else 0
        if not self._local or self._size >= self.segment_bytes:
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

    def disk_bytes(self) -> int:
        """Bytes the segment files hold (what ``gc`` can give back, and what monitoring shows);
        a segment deleted meanwhile counts nothing. One listing on an object store (a segment
        per commit there: a request per segment would be thousands per scrape)."""
        if self._local:
            return sum(self._segment_size(seg) for seg in self.segments())
        assert self._fs is not None
        infos = self._fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return sum(i.size or 0 for i in infos if _SEGMENT_NAME.match(i.base_name))

    def _segment_size(self, segment: int) -> int:
        if self._local:
            try:
                return os.path.getsize(self._path(segment))
            except FileNotFoundError:
                return 0
        assert self._fs is not None
        return self._fs.get_file_info(self._path(segment)).size or 0

    # -- writing (writer thread) -----------------------------------------------------------------
    @property
    def direct_io(self) -> bool:
        """Whether segments are written with ``O_DIRECT`` now (store/blob_writes.py)."""
        return self._writes.direct

    def append(self, chunk: Chunk) -> str:
        """Stage a chunk for the next :meth:`sync`; return its key prefix (add ``:{row}``)."""
        if not self._pending:
            if self._local and self._size > self.segment_bytes:
                self._segment += 1
                self._size = 0
            # O_DIRECT writes start on a block boundary; what lies before it is padding (or,
            # after a crash, a torn tail) that no key points into.
            self._start = self._end = align_up(self._size) if self.direct_io else self._size
        if isinstance(chunk, ColumnChunk) and self.direct_io and len(chunk) < IN_PLACE_MIN_BYTES:
            chunk = chunk.serialized()  # copied back to back, as other small chunks are
        whole = in_place(chunk) if self.direct_io else None
        aligned = self.direct_io and (whole is not None or isinstance(chunk, ColumnChunk))
        if aligned:
            # written from a page-aligned buffer: on a block boundary, padded to the next one
            self._end = align_up(self._end)
        self._pending.append(Staged(self._end, chunk, whole))
        key = f"{self._segment}:{self._end}:{len(chunk)}"
        self._end += align_up(len(chunk)) if aligned else len(chunk)
        return key

    @property
    def pending_bytes(self) -> int:
        """Bytes staged for the next :meth:`sync` (with the padding between them)."""
        return self._end - self._start if self._pending else 0

    def sync(self) -> None:
        """Write and fsync the staged chunks. On failure nothing staged is kept.

        The writer may run this on its blob thread; it touches nothing else of the store
        meanwhile (no :meth:`append`, :meth:`roll` or :meth:`collect` until it returns)."""
        if not self._pending:
            return
        pieces, total, start = self._pending, self._end - self._start, self._start
        self._pending = []
        segment = self._segment
        path = self._path(segment)
        try:
            if self._local:
                self._size = self._writes.write(path, pieces, start, total, self._size)
            else:
                assert self._fs is not None
                with self._fs.open_output_stream(path) as out:
                    for piece in pieces:       # back to back: only local stores pad
                        out.write(in_memory(piece.chunk))
                self._segment += 1
                self._size = 0
        except OSError as e:
            raise StorageError(f"cannot write blob segment {path!r}: {e}") from e
        self._keep_recent(segment, pieces)

    def _keep_recent(self, segment: int, pieces: list[Staged]) -> None:
        """Keep the chunks just made durable readable from memory, the newest up to
        :attr:`recent_bytes`: their values as arrays over the buffers the put serialised them
        into (nothing is copied), from which a read slices or takes its rows.

        Why: O_DIRECT writes leave nothing in the page cache, so a claim of fresh rows read
        them back from the device; trainers read what producers just wrote. The bytes never
        left the process, so they are neither checksummed nor validated again."""
        if not self.recent_bytes:
            return
        held = []
        for ck, values, size in _as_received(segment, pieces):
            if len(values) and size <= self.recent_bytes:
                held.append((ck, values, size))
        for piece in pieces:
            if isinstance(piece.chunk, ColumnChunk):
                continue
            chunk = piece.chunk if isinstance(piece.chunk, pa.Buffer) \
                else pa.py_buffer(piece.chunk)
            if HEADER_BYTES < len(chunk) <= self.recent_bytes:
                stream = pa.ipc.open_stream(chunk.slice(HEADER_BYTES))  # stops before an index
                held.append(((segment, piece.offset, len(chunk)),
                             one_array(stream.read_next_batch().column(0)), len(chunk)))
        with self._cache_lock:
            for ck, values, size in held:
                self._recent[ck] = (values, size)
                self._recent_held += size
            while self._recent_held > self.recent_bytes:
                self._recent_held -= self._recent.popitem(last=False)[1][1]

    def roll(self) -> None:
        """Start a new segment, so that the one written so far can be collected when no row
        references it any more (GC never deletes the segment being written)."""
        if self._local and self._size > 0 and not self._pending:
            self._segment += 1
            self._size = 0

    def rollback(self) -> None:
        """Forget staged chunks (their group commit failed before sync)."""
        self._pending.clear()

    # -- reading -----------------------------------------------------------------------------
    def _chunk(self, segment: int, offset: int, length: int) -> pa.Array:
        ck = (segment, offset, length)
        with self._cache_lock:
            hit = self._cache.get(ck)
            if hit is not None:
                self._cache.move_to_end(ck)
                return hit
        path = self._path(segment)
        data = self._preader(segment)(offset, length)  # read and size-checked as row reads are
        body = chunk_body(data)
        if body is None:
            raise StorageError(f"blob chunk {segment}:{offset}:{length} in {path!r} is corrupt: "
                               "its header or checksum does not match its bytes")
        try:
            values = one_array(pa.ipc.open_stream(pa.py_buffer(body)).read_all().column(0))
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

    def chunk(self, prefix: str) -> pa.Array:
        """A whole chunk's values, by the key prefix :meth:`append` returned
        (``segment:offset:length``): what a cluster's data node copies to another node."""
        ck = chunk_key(prefix)
        segment, offset, length = ck
        with self._cache_lock:
            held = self._recent.get(ck)
        if held is not None:
            return held[0]
        index = self._index(segment, offset, length)
        if index is None:
            return self._chunk(segment, offset, length)
        return self._read_rows(ck, index, list(range(index.rows)))

    def put_columns(self, source: pa.Table, key_ats: Sequence[int], rows: RowCut,
                    value_types: Sequence[pa.DataType]) -> list[pa.Array | None]:
        """For each key column ``key_ats[i]`` of ``source``, rows ``rows`` of the values it
        refers to (as ``value_types[i]``), cut straight from a chunk kept in memory (see
        :meth:`_keep_recent`); None where that is not so (then :meth:`resolve` the keys).

        ``source`` is a put as the claim cache holds it: columns of keys the writer built with
        :func:`keys_for`, each naming one chunk's rows in order. Why: a claim then cuts its rows
        by their row numbers, without parsing and grouping a key per value (most of a claim's
        time in the store for a few wide rows); whether a column is such a column the writer
        records as it builds the keys (:meth:`know_whole`), else it is checked once per cached
        put. Why all of a claim's columns in one call: a lookup and a lock per
        column were a noticeable share of a claim of a few rows."""
        out: list[pa.Array | None] = []
        for values, value_type in zip(self.put_values(source, key_ats), value_types):
            if values is None:
                out.append(None)
                continue
            got = rows.array(values)
            out.append(got if got.type == value_type else got.cast(value_type))
        return out

    def put_values(self, source: pa.Table, key_ats: Sequence[int]) -> list[pa.Array | None]:
        """For each key column ``key_ats[i]`` of ``source`` (a cached put, as for
        :meth:`put_columns`), the values of every row it refers to, as the chunk kept in memory
        holds them (row ``j`` of the array is row ``j`` of the put; its type as put, which may
        differ from the column's declared type); None where no such chunk is held."""
        chunks = self._whole_chunks(source, key_ats)
        with self._cache_lock:
            held = [None if ck is None else self._recent.get(ck) for ck in chunks]
        return [None if h is None else h[0] for h in held]

    def know_whole(self, source: pa.Table,
                   by_column: Mapping[int, tuple[int, int, int] | None]) -> None:
        """Record, for key columns of ``source`` (by position), the chunk whose rows 0 … n-1
        each names in order, or None where it names anything else: what :meth:`put_columns`
        would otherwise find out on the put's first claim.

        Why: the writer knows it when it builds the keys (:meth:`RowWriter.with_blob_keys`);
        checking the keys again cost a put's first claim a noticeable share of its time. A
        column marked with a chunk it does not name in full would serve wrong values."""
        self._whole_memo(source).update(by_column)

    def _whole_memo(self, source: pa.Table) -> dict[int, tuple[int, int, int] | None]:
        """The whole chunks known for the columns of ``source`` (kept while it lives)."""
        return self._whole.of(source, dict)

    def _whole_chunks(self, source: pa.Table,
                      key_ats: Sequence[int]) -> list[tuple[int, int, int] | None]:
        """The chunk each key column of ``source`` names whole (:func:`whole_chunk`), checked
        once per cached put and column unless the writer recorded it (:meth:`know_whole`)."""
        by_column = self._whole_memo(source)
        out = []
        for at in key_ats:
            if at not in by_column:
                by_column[at] = whole_chunk(source.column(at))
            out.append(by_column[at])
        return out

    def resolve(self, keys: Sequence[str | None], value_type: pa.DataType) -> pa.Array:
        """The values for ``keys`` (None stays null), in order.

        Rows of format-3 chunks are read alone (their blocks, see :mod:`store.blob_rows`);
        chunks of older formats are read whole."""
        by_prefix: dict[str, list[tuple[int, int]]] = {}
        for pos, key in enumerate(keys):
            if key is None:
                continue
            prefix, _, row = key.rpartition(":")
            try:
                by_prefix.setdefault(prefix, []).append((pos, int(row)))
            except ValueError:
                raise StorageError(f"blob key {key!r} is malformed") from None
        if not by_prefix:
            return pa.nulls(len(keys), value_type)
        positions: list[int] = []
        pieces: list[pa.Array] = []
        for prefix, items in by_prefix.items():
            try:
                ck = chunk_key(prefix)
            except ValueError:
                raise StorageError(f"blob key {prefix}:{items[0][1]!r} is malformed") from None
            pieces.append(self._rows(ck, [r for _, r in items], value_type))
            positions.extend(p for p, _ in items)
        values = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
        if len(positions) == len(keys) and positions == list(range(len(keys))):
            return values                    # every key, in key order: nothing to scatter
        # Scatter back into key order: nulls where the key was None.
        order = [-1] * len(keys)
        for i, p in enumerate(positions):
            order[p] = i
        return values.take(pa.array([o if o >= 0 else None for o in order], pa.int64()))

    def resolve_keys(self, keys: pa.Array | pa.ChunkedArray,
                     value_type: pa.DataType) -> pa.Array | None:
        """The values of ``keys`` when they are one chunk's consecutive rows in order (a column
        of a put, or a run of it, as SQL reads them), checked and cut without a Python step per
        key; else None (then :meth:`resolve` them). Why: parsing and grouping each key in
        Python was most of the time of ``SELECT *`` over by-reference columns."""
        if len(keys) < 2 or keys.null_count:
            return None
        prefix, _, row = str(keys[0].as_py()).rpartition(":")
        try:
            ck = chunk_key(prefix)
            first = int(row)
        except ValueError:
            return None
        if min(*ck, first) < 0:
            return None
        # built from the numbers read: a key spelled any other way differs from it
        if not names_rows(keys, ":".join(map(str, ck)), first):
            return None
        return self._rows(ck, range(first, first + len(keys)), value_type)

    def _rows(self, ck: tuple[int, int, int], rows: Sequence[int],
              value_type: pa.DataType) -> pa.Array:
        """Rows ``rows`` of chunk ``ck``, in that order, as ``value_type``: from memory where the
        chunk is held, by its index (format 3), else from the whole chunk. ``rows`` may be a
        ``range`` (a run of keys in order), bounds-checked and cut without a step per row."""
        with self._cache_lock:
            held = self._recent.get(ck)
        index = self._index(*ck) if held is None else None
        whole = held[0] if held is not None else \
            self._chunk(*ck) if index is None else None
        size = index.rows if index is not None else len(whole)  # type: ignore[arg-type]
        low, high = (rows[0], rows[-1]) if isinstance(rows, range) and rows.step == 1 \
            else (min(rows), max(rows))
        if low < 0 or high >= size:
            raise StorageError(f"blob key row out of range in chunk {ck}")
        if whole is None:
            piece = self._read_rows(ck, index, list(rows))
        else:
            piece = cut(whole, rows)
        return piece if piece.type == value_type else piece.cast(value_type)

    def _read_rows(self, ck: tuple[int, int, int], index: blob_rows.ChunkIndex | None,
                   rows: list[int]) -> pa.Array:
        """Rows of a format-3 chunk, in the order given: each run of rows whose blocks touch
        is read in one pass (a zero-copy slice when the rows are consecutive, else a take)."""
        assert index is not None
        segment, offset, _ = ck
        pread = self._preader(segment)

        def fetch(i: int, lo: int, hi: int) -> pa.Buffer:
            return pread(offset + index.buffers[i][0] + lo, hi - lo)

        ordered = sorted(set(rows))
        block = index.block_rows
        runs: list[list[int]] = [[ordered[0]]]
        for r in ordered[1:]:
            if r // block > runs[-1][-1] // block + 1:
                runs.append([r])
            else:
                runs[-1].append(r)
        parts: list[pa.Array] = []
        try:
            for run in runs:
                first, end = run[0], run[-1] + 1
                values = blob_rows.read_rows(index, first, end, fetch)
                if len(run) != end - first:
                    values = values.take(pa.array([r - first for r in run], pa.int64()))
                values.validate()
                parts.append(values)
        except (ValueError, pa.ArrowException) as e:
            raise StorageError(f"blob chunk {segment}:{offset}:{ck[2]} in "
                               f"{self._path(segment)!r} is corrupt: {e}") from e
        got = parts[0] if len(parts) == 1 else pa.concat_arrays(parts)
        if rows == ordered:
            return got
        where = {r: i for i, r in enumerate(ordered)}
        return got.take(pa.array([where[r] for r in rows], pa.int64()))

    def _index(self, segment: int, offset: int, length: int) -> blob_rows.ChunkIndex | None:
        """A format-3 chunk's index (cached), or None for a chunk of an older format."""
        ck = (segment, offset, length)
        with self._cache_lock:
            if ck in self._indexes:
                self._indexes.move_to_end(ck)
                return self._indexes[ck]
        pread = self._preader(segment)
        where = f"blob chunk {segment}:{offset}:{length} in {self._path(segment)!r}"
        head = pread(offset, min(HEADER_BYTES, length)).to_pybytes()
        index: blob_rows.ChunkIndex | None = None
        if head[:4] == blob_rows.INDEX_MAGIC and len(head) == HEADER_BYTES:
            size = int.from_bytes(head[4:8], "little")
            if not 0 < size <= length - HEADER_BYTES:
                raise StorageError(f"{where} is corrupt: its index length {size} does not "
                                   "fit the chunk")
            data = pread(offset + length - size, size).to_pybytes()
            if xxhash.xxh3_64_intdigest(data).to_bytes(8, "little") != head[8:]:
                raise StorageError(f"{where} is corrupt: its index does not match its "
                                   "checksum")
            try:
                index = blob_rows.parse_index(data)
            except (ValueError, pa.ArrowException) as e:
                raise StorageError(f"{where} is corrupt: {e}") from e
        with self._cache_lock:
            self._indexes[ck] = index
            while len(self._indexes) > INDEX_CACHE:
                self._indexes.popitem(last=False)
        return index

    def _preader(self, segment: int) -> Callable[[int, int], pa.Buffer]:
        """``pread(offset, length)`` of a segment: on a descriptor kept open (a few are), or
        a file of the store's filesystem."""
        path = self._path(segment)
        if not self._local:
            fs = self._fs
            assert fs is not None

            def read_remote(offset: int, length: int) -> pa.Buffer:
                try:
                    with fs.open_input_file(path) as f:
                        data = f.read_at(length, offset)
                except (OSError, pa.ArrowException) as e:
                    raise StorageError(f"blob segment {path!r} cannot be read: {e}") from e
                if len(data) != length:
                    raise StorageError(f"blob bytes {offset}+{length} are truncated in "
                                       f"{path!r} ({len(data)} of {length} bytes)")
                return pa.py_buffer(data)
            return read_remote
        handle = self._fd(segment)

        def read_local(offset: int, length: int) -> pa.Buffer:
            buf = pa.allocate_buffer(length)
            try:
                got = os.preadv(handle.fd, [memoryview(buf)], offset) if length else 0
            except OSError as e:
                raise StorageError(f"blob segment {path!r} cannot be read: {e}") from e
            if got != length:
                raise StorageError(f"blob bytes {offset}+{length} are truncated in {path!r} "
                                   f"({got} of {length} bytes)")
            return buf
        return read_local

    def _fd(self, segment: int) -> "OpenSegment":
        with self._cache_lock:
            handle = self._fds.get(segment)
            if handle is not None:
                self._fds.move_to_end(segment)
                return handle
            try:
                handle = OpenSegment(os.open(self._path(segment), os.O_RDONLY))
            except OSError as e:
                raise StorageError(f"blob segment {self._path(segment)!r} cannot be read: "
                                   f"{e}") from e
            self._fds[segment] = handle
            while len(self._fds) > OPEN_SEGMENTS:
                self._fds.popitem(last=False)   # closed once no read holds it
            return handle

    def close(self) -> None:
        """Let go of the segment files kept open for reading (each closes once no read under
        way holds it)."""
        with self._cache_lock:
            self._fds.clear()

    # -- garbage collection ----------------------------------------------------------------------
    def collect(self, live_segments: Iterable[int], *,
                keep_newer_than: float | None = None) -> dict[str, int]:
        """Delete whole segments that no row references (never the one being written, nor,
        with ``keep_newer_than``, one modified at or after that time, in seconds since the
        epoch: a cluster's data node keeps the segments of puts whose keys may still be on
        their way to the coordinator)."""
        live = set(live_segments) | {self._segment}
        removed = freed = 0
        for seg in self.segments():
            if seg in live:
                continue
            if keep_newer_than is not None and self._local and \
                    os.path.getmtime(self._path(seg)) >= keep_newer_than:
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
            self._indexes.clear()
            self._recent.clear()
            self._recent_held = 0
        self.close()                     # descriptors of deleted segments go too
        return {"segments_removed": removed, "bytes_freed": freed}


def _as_received(segment: int, pieces: Sequence[Staged]) \
        -> list[tuple[tuple[int, int, int], pa.Array, int]]:
    """The values of the ColumnChunks among ``pieces`` by chunk, to keep in memory for reads,
    and the bytes each holds.

    A column received in a Flight batch is a slice of the one buffer that holds the whole
    batch: keeping it keeps that buffer. Kept as they came where the chunks are most of that
    buffer (a put of by-reference columns), each counted for its share of it; copied into
    memory of their own otherwise (counted for their chunk's length)."""
    columns = [((segment, p.offset, len(p.chunk)), p.chunk.values) for p in pieces
               if isinstance(p.chunk, ColumnChunk)]
    counted: dict[int, int] = {}             # parent buffer: bytes of chunks over it
    for (_, _, length), values in columns:
        for address in _parents(values):
            counted[address] = counted.get(address, 0) + length
    out = []
    for ck, values in columns:
        parents = _parents(values)
        length = ck[2]
        if any(size > 2 * counted[address] for address, size in parents.items()):
            out.append((ck, pa.concat_arrays([values]), length))
        else:
            out.append((ck, values, max(length, sum(size * length // counted[address]
                                                    for address, size in parents.items()))))
    return out


def _parents(values: pa.Array) -> dict[int, int]:
    """The buffers ``values``' buffers (its children's too) are slices of (address: size)."""
    return {buf.parent.address: buf.parent.size for buf in values.buffers()
            if buf is not None and buf.parent is not None}
