"""Writing a group commit's staged chunks into a local segment file: with ``O_DIRECT`` where the
filesystem takes it, else buffered; then ``fsync``, and on failure the file cut back to where it
ended before.

Apart from :mod:`store.blobs`, which decides where each chunk goes (its offset, the alignment
``O_DIRECT`` needs) and when it is durable, this is how one group's bytes are written: large
chunks from their own page-aligned memory, a :class:`~store.blob_chunks.ColumnChunk` serialised
into one of two reused buffers while the one before it is written, the others copied through a
page-aligned staging buffer. The positional writes themselves are :mod:`store.blob_files`.
"""
from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from contextlib import contextmanager
from typing import Iterator

import pyarrow as pa

from .blob_chunks import ALIGN, ColumnChunk, align_up
from .blob_files import O_DIRECT, Staged, pwrite_all, pwrite_pieces, write_staged

DIRECT_MIN_BYTES = 64 << 10         # smaller group commits are written buffered (same alignment;
                                    # no faster either way there)
STAGING_BYTES = 16 << 20            # the page-aligned buffer O_DIRECT writes go through
# ColumnChunks up to this size are serialised, for an O_DIRECT write, into one of two buffers
# the store keeps (their pages stay mapped from one write to the next; each grows to the largest
# chunk it took); larger ones into new memory.
SLOT_BYTES = 32 << 20
# Writes of serialised ColumnChunks, so that the next one is serialised meanwhile (a few
# threads: several stores in one process write at once).
_WRITES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="expstore-blob-write")


class SegmentWriter:
    """Writes staged chunks into local segment files (the blob store's writer thread only).

    Args:
        direct: write with ``O_DIRECT`` (the caller probed that the filesystem takes it); a
            write the filesystem refuses (``EINVAL``) turns it off for good (:attr:`direct`).
    """

    def __init__(self, direct: bool) -> None:
        self.direct = direct
        self._staging: mmap.mmap | None = None
        self._slots: list[tuple[pa.Buffer, memoryview] | None] = [None, None]  # see _slot

    def write(self, path: str, pieces: list[Staged], start: int, total: int,
              durable_end: int) -> int:
        """Write ``pieces`` (``total`` bytes from ``start``) into segment file ``path`` and
        fsync; return the segment's new end. A failed write is cut back to ``durable_end``, the
        segment's end before it (it would otherwise leave garbage that later offsets skip)."""
        if self.direct and total >= DIRECT_MIN_BYTES:
            try:
                return self._write_direct(path, pieces, start, total, durable_end)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False      # refused here: buffered from now on, and rewrite
        with self._appending(path, 0, durable_end) as fd:
            pwrite_pieces(fd, pieces)
        return start + total

    @contextmanager
    def _appending(self, path: str, flags: int, durable_end: int) -> Iterator[int]:
        """The segment open for writing; fsynced when the block ends, cut back to its last
        durable end if a write or the fsync fails."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
        try:
            try:
                yield fd
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, durable_end)
                raise
        finally:
            os.close(fd)

    def _write_direct(self, path: str, pieces: list[Staged], start: int, total: int,
                      durable_end: int) -> int:
        """O_DIRECT: ColumnChunks serialised into two slots in turn, each written (on a write
        thread) while the next is serialised; other large chunks straight from their own
        page-aligned, padded memory; the others copied through a page-aligned buffer into
        block-aligned writes, each run's last write padded with zeros; fsync (file size, device
        cache) as in the buffered path."""
        assert O_DIRECT is not None and start % ALIGN == 0
        if self._staging is None:
            self._staging = mmap.mmap(-1, align_up(max(STAGING_BYTES, ALIGN)))
        staging = self._staging
        cap = len(staging)
        with self._appending(path, O_DIRECT, durable_end) as fd:
            offset, fill = start, 0            # the staging buffer holds [offset, offset + fill)
            # A ColumnChunk is serialised into one of two slots while the one before it is
            # written from the other (on a write thread): ``writing`` is that write.
            writing: Future | None = None
            slot = 0
            try:
                for piece in pieces:
                    if not isinstance(piece.chunk, ColumnChunk):
                        continue
                    into, view = self._slot(slot, piece.chunk.padded())
                    n = piece.chunk.write_into(into)
                    if writing is not None:
                        done, writing = writing, None
                        done.result()
                    writing = _WRITES.submit(pwrite_all, fd, view[:n], piece.offset)
                    slot ^= 1
                if writing is not None:
                    done, writing = writing, None
                    done.result()
            finally:
                if writing is not None:    # failed meanwhile: the write ends before the file
                    wait_futures([writing])  # is cut back and closed
            for piece in pieces:
                if isinstance(piece.chunk, ColumnChunk):
                    if fill:                   # the run before it ends where it starts
                        write_staged(fd, staging, fill, offset)
                        fill = 0
                    offset = piece.offset + piece.chunk.padded()
                    continue
                if piece.whole is not None:
                    if fill:                   # the run before it ends where it starts
                        write_staged(fd, staging, fill, offset)
                        fill = 0
                    offset = pwrite_all(fd, piece.whole, piece.offset)
                    continue
                with memoryview(piece.chunk) as view:
                    pos, n = 0, len(view)
                    while pos < n:
                        take = min(n - pos, cap - fill)
                        staging[fill:fill + take] = view[pos:pos + take]
                        fill += take
                        pos += take
                        if fill == cap:
                            offset = write_staged(fd, staging, cap, offset)
                            fill = 0
            if fill:
                offset = write_staged(fd, staging, fill, offset)
        return offset

    def _slot(self, slot: int, size: int) -> tuple[pa.Buffer, memoryview]:
        """A page-aligned buffer of at least ``size`` bytes to serialise a ColumnChunk into
        (as a mutable Arrow buffer, and a view of it): slot 0 or 1, kept from write to write
        and grown to the largest chunk up to :data:`SLOT_BYTES`; new memory beyond that."""
        if size > SLOT_BYTES:
            memory = mmap.mmap(-1, size)
            return pa.py_buffer(memory), memoryview(memory)
        held = self._slots[slot]
        if held is None or held[0].size < size:
            memory = mmap.mmap(-1, max(size, 4 << 20))
            held = self._slots[slot] = (pa.py_buffer(memory), memoryview(memory))
        return held
