"""Segment files at the operating system's level: whether a filesystem takes ``O_DIRECT``
writes, positional writes (``pwrite``, ``pwritev``) of staged chunks and of the page-aligned
staging buffer, and the descriptors that reads keep open.

Apart from :mod:`store.blobs` so that the blob store reads as what it decides (where each chunk
goes, when it is durable, what stays in memory), and this as how the bytes reach the file.
"""
from __future__ import annotations

import mmap
import os
import uuid
from typing import NamedTuple, Sequence

from .blob_chunks import ALIGN, Chunk, align_up, in_memory

# O_DIRECT segment writes: off with EXPSTORE_BLOB_DIRECT_IO=0 (or StoreSettings.blob_direct_io),
# and off by itself where the filesystem refuses them.
DIRECT_IO = os.environ.get("EXPSTORE_BLOB_DIRECT_IO", "1").strip().lower() not in (
    "0", "false", "no", "off")
O_DIRECT: int | None = getattr(os, "O_DIRECT", None)
_IOV_MAX = 1024                     # buffers per pwritev call (Linux's IOV_MAX)


class Staged(NamedTuple):
    """A chunk staged for the next sync, where it goes, and (written in place) its padded
    memory."""

    offset: int
    chunk: Chunk
    whole: memoryview | None


def probe_direct(root: str, wanted: bool = True) -> bool:
    """Whether ``root``'s filesystem takes an aligned O_DIRECT write (tmpfs refuses the open)."""
    if not wanted or O_DIRECT is None:
        return False
    path = os.path.join(root, f".direct-probe-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
    except OSError:
        return False
    buf = mmap.mmap(-1, ALIGN)
    try:
        return os.pwrite(fd, buf, 0) == ALIGN
    except OSError:
        return False
    finally:
        buf.close()
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


class OpenSegment:
    """A segment's read descriptor, closed when the last reference to it goes: a read under
    way keeps it open while the cache lets go of it (a closed number could be reused by
    another file meanwhile)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)


def pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    """Write all of ``view`` at ``offset``; return the offset after it."""
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
    return offset


def write_staged(fd: int, staging: mmap.mmap, fill: int, offset: int) -> int:
    """Write the staging buffer's first ``fill`` bytes at ``offset``, zero-padded to a block
    boundary (O_DIRECT writes whole blocks); return the offset after them."""
    padded = align_up(fill)
    staging[fill:padded] = bytes(padded - fill)
    with memoryview(staging) as out:
        return pwrite_all(fd, out[:padded], offset)


def pwrite_pieces(fd: int, pieces: Sequence[Staged]) -> None:
    """Write each piece at its offset (padding included), a run of adjacent ones with pwritev,
    without joining them."""
    views = [(p.offset, memoryview(p.whole if p.whole is not None else in_memory(p.chunk))
              .cast("B")) for p in pieces if len(p.chunk)]
    i = 0
    while i < len(views):
        j = i + 1
        while j < len(views) and views[j][0] == views[j - 1][0] + len(views[j - 1][1]):
            j += 1
        _pwritev_run(fd, [v for _, v in views[i:j]], views[i][0])
        i = j


def _pwritev_run(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back from ``offset``."""
    if not hasattr(os, "pwritev"):
        pwrite_all(fd, memoryview(b"".join(views)), offset)
        return
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i:i + _IOV_MAX], offset)
        offset += n
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
