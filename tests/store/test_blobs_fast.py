"""Blob segment writes: O_DIRECT to 4 KiB-aligned offsets (zero padding between group commits)
and the buffered fallback, both readable, both cut a failed write off again; segments written by
the code before O_DIRECT (no padding, CRC-32 chunks) still read, and a store appends after them;
chunks carry a checksum that every read checks."""
from __future__ import annotations

import errno
import io
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import xxhash

import store
import store.blob_chunks as blob_chunks
import store.blob_files as blob_files
import store.blob_writes as blob_writes
from store import blob_rows
from store.blob_chunks import ALIGN, serialize_chunk_buffer
from store.blob_writes import SegmentWriter
from store.blobs import BlobStore
from store.errors import StorageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _values(n: int, width: int, tag: str) -> pa.Array:
    return pa.array([(f"{tag}{i}:" + "v" * width)[:width] for i in range(n)], pa.large_string())


def _open(root: str, direct: bool, monkeypatch) -> BlobStore:
    b = BlobStore(root, direct_io=direct)
    if direct and not b.direct_io:
        pytest.skip(f"the filesystem of {root} refuses O_DIRECT")
    assert b.direct_io is direct
    return b


def _put(b: BlobStore, arrays: list[pa.Array], buffer: bool = False) -> list[str]:
    keys = [b.append(serialize_chunk_buffer(a) if buffer else serialize_chunk_buffer(a).to_pybytes())
            for a in arrays]
    b.sync()
    return keys


def _check(b: BlobStore, keys: list[str], arrays: list[pa.Array]) -> None:
    for key, arr in zip(keys, arrays):
        got = b.resolve([f"{key}:{r}" for r in range(len(arr))], arr.type)
        assert got.equals(arr), key


BIG = 600 << 10                      # above DIRECT_MIN_BYTES: written with O_DIRECT
SMALL = 3000                         # below it: buffered, at an aligned start all the same


def test_serialize_chunk_layout():
    """Format 3: magic, the index's length and XXH3-64, the IPC stream (the same stream bytes as
    formats 1 and 2), then the row index (see store.blob_rows)."""
    arr = _values(50, 700, "s")
    body = _ipc_stream(arr)
    chunk = serialize_chunk_buffer(arr).to_pybytes()
    size = int.from_bytes(chunk[4:8], "little")
    assert chunk[:4] == b"EXB3" and len(chunk) == 16 + len(body) + size
    assert chunk[16:16 + len(body)] == body
    index = chunk[-size:]
    assert xxhash.xxh3_64_intdigest(index).to_bytes(8, "little") == chunk[8:16]
    parsed = blob_rows.parse_index(index)
    assert parsed.rows == 50 and parsed.block_rows % 8 == 0 and parsed.type == arr.type
    assert len(parsed.hashes) == -(-50 // parsed.block_rows)


def _format2_chunk(values: pa.Array) -> bytes:
    """A chunk as the code before row indexes wrote it: magic, four zero bytes, XXH3-64."""
    body = _ipc_stream(values)
    return b"EXB2" + bytes(4) + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body


def test_chunk_body_checks_either_format_and_refuses_damage():
    arr = _values(20, 300, "f")
    body = _ipc_stream(arr)
    new = _format2_chunk(arr)
    old = _old_serialize_chunk(arr)
    assert bytes(blob_chunks.chunk_body(new)) == body
    assert bytes(blob_chunks.chunk_body(old)) == body
    for chunk in (new, old):
        for pos in (0, 5, 9, len(chunk) // 2, len(chunk) - 1):  # header, digest, body
            damaged = bytearray(chunk)
            damaged[pos] ^= 0x20
            assert blob_chunks.chunk_body(bytes(damaged)) is None, pos
    # A new chunk whose bytes 4-8 turned into IPC's marker is read as format 1: still refused.
    assert blob_chunks.chunk_body(new[:4] + b"\xff" * 4 + new[8:]) is None
    assert blob_chunks.chunk_body(b"") is None and blob_chunks.chunk_body(b"EXB2") is None


@pytest.mark.parametrize("where", ["value", "index"])
def test_damaged_chunk_is_reported_corrupt_on_read(tmp_path, monkeypatch, where):
    b = _open(str(tmp_path / "blobs"), False, monkeypatch)
    arrays = [_values(30, 500, "a"), _values(30, 500, "b")]
    keys = _put(b, arrays)
    segment, offset, length = map(int, keys[1].split(":"))
    # a byte of row 20's value, or the last byte of the index
    at = offset + length // 2 if where == "value" else offset + length - 1
    with open(b._path(segment), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    fresh = BlobStore(str(tmp_path / "blobs"))
    _check(fresh, keys[:1], arrays[:1])
    with pytest.raises(StorageError, match="is corrupt: .*(checksum)"):
        fresh.resolve([f"{keys[1]}:{r}" for r in range(30)], arrays[1].type)


def _ipc_stream(values: pa.Array) -> bytes:
    sink = io.BytesIO()
    batch = pa.record_batch([values], names=["v"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_segments_round_trip_small_and_big_group_commits(tmp_path, monkeypatch, direct):
    b = _open(str(tmp_path / "blobs"), direct, monkeypatch)
    path = b._path(b._segment)
    written: list[tuple[list[str], list[pa.Array]]] = []
    ends = []
    for i, (rows, width) in enumerate([(3, SMALL), (200, BIG // 200), (2, SMALL),
                                       (1, 50), (400, BIG // 100)]):
        arrays = [_values(rows, width, f"g{i}c{j}") for j in range(3)]
        keys = _put(b, arrays, buffer=i % 2 == 1)
        written.append((keys, arrays))
        ends.append(os.path.getsize(path))
        starts = [int(k.split(":")[1]) for k in keys]
        lengths = [int(k.split(":")[2]) for k in keys]
        # Large chunks from serialize_chunk_buffer are written by O_DIRECT from their own
        # memory, on a block boundary; the others lie back to back.
        in_place = [direct and i % 2 == 1 and n >= blob_chunks.IN_PLACE_MIN_BYTES for n in lengths]
        if i == 1:  # big chunks given as buffers: written in place exactly when O_DIRECT is on
            assert all(in_place) is direct
        for j in (1, 2):
            prev_end = starts[j - 1] + lengths[j - 1]
            aligned = in_place[j] or in_place[j - 1]
            assert starts[j] == (blob_chunks.align_up(prev_end) if aligned else prev_end), (i, j)
        prev_end = ends[-2] if len(ends) > 1 else 0
        if direct:
            # A group starts on a block boundary; big ones end on one too. Every gap is zeros.
            assert starts[0] % ALIGN == 0 and prev_end <= starts[0] < prev_end + ALIGN
            if sum(lengths) >= blob_writes.DIRECT_MIN_BYTES:
                assert ends[-1] % ALIGN == 0 and ends[-1] - starts[-1] - lengths[-1] < ALIGN
                with open(path, "rb") as f:
                    for gap_start, gap_end in zip([a + n for a, n in zip(starts, lengths)],
                                                  starts[1:] + [ends[-1]]):
                        pad = os.pread(f.fileno(), gap_end - gap_start, gap_start)
                        assert pad == bytes(len(pad))
        else:
            # The old layout: contiguous, no padding.
            assert starts[0] == prev_end and ends[-1] == starts[-1] + lengths[-1]
    for keys, arrays in written:
        _check(b, keys, arrays)
    reopened = BlobStore(str(tmp_path / "blobs"))
    for keys, arrays in written:
        _check(reopened, keys, arrays)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_batch_bigger_than_the_staging_buffer_and_many_pieces(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(blob_writes, "STAGING_BYTES", 64 << 10)
    monkeypatch.setattr(blob_files, "_IOV_MAX", 7)
    b = _open(str(tmp_path / "blobs"), direct, monkeypatch)
    arrays = [_values(5, 3001 + 37 * j, f"p{j}") for j in range(40)]     # ~600 KB, 40 pieces
    keys = _put(b, arrays)
    _check(b, keys, arrays)
    _check(BlobStore(str(tmp_path / "blobs")), keys, arrays)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_chunks_written_in_place_between_copied_ones(tmp_path, monkeypatch, direct):
    """Large chunks written from their own memory, small ones copied through a staging buffer
    smaller than one group (so it fills and flushes between them), in one group commit."""
    monkeypatch.setattr(blob_writes, "STAGING_BYTES", 64 << 10)
    b = _open(str(tmp_path / "blobs"), direct, monkeypatch)
    arrays = [_values(40, 2900, f"big{j}") if j % 3 == 0 else _values(3, 700 + 31 * j, f"s{j}")
              for j in range(16)] + [_values(60, 900, f"s{j}") for j in range(2)]
    chunks = [serialize_chunk_buffer(a) for a in arrays]
    keys = [b.append(c) for c in chunks]
    assert sum(blob_chunks.in_place(c) is not None for c in chunks) == 6
    b.sync()
    _check(b, keys, arrays)
    _check(BlobStore(str(tmp_path / "blobs")), keys, arrays)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_failed_write_is_cut_off_and_nothing_staged_is_kept(tmp_path, monkeypatch, direct):
    b = _open(str(tmp_path / "blobs"), direct, monkeypatch)
    first = [_values(100, 7000, "ok")]
    keys = _put(b, first)
    path = b._path(b._segment)
    size = os.path.getsize(path)

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(blob_writes.os, "fsync", no_space)
    b.append(serialize_chunk_buffer(_values(100, 7000, "lost")))
    with pytest.raises(StorageError, match="cannot write blob segment"):
        b.sync()
    assert os.path.getsize(path) == size
    monkeypatch.undo()
    again = [_values(100, 7000, "again")]
    keys2 = _put(b, again)
    _check(b, keys + keys2, first + again)


def _received(*arrays: pa.Array) -> list[pa.Array]:
    """``arrays`` as a Flight batch's columns arrive: read back from one IPC stream, slices of
    its one read-only buffer."""
    batch = pa.record_batch(list(arrays), names=[f"c{i}" for i in range(len(arrays))])
    read = pa.ipc.open_stream(pa.py_buffer(_ipc_stream_of(batch))).read_next_batch()
    return list(read.columns)


def _ipc_stream_of(batch: pa.RecordBatch) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


def test_read_only_tells_received_columns_from_a_callers_arrays():
    import numpy as np
    received = _received(_values(10, 100, "r"), pa.array(np.arange(10.0)))
    assert all(blob_chunks.read_only(c) for c in received)
    assert blob_chunks.read_only(pa.chunked_array(received[:1]))
    assert not blob_chunks.read_only(pa.array(np.arange(10.0)))         # over numpy's memory
    assert not blob_chunks.read_only(_values(10, 100, "mine"))
    assert isinstance(blob_chunks.column_chunk(received[0], owned=False), pa.Buffer)
    assert isinstance(blob_chunks.column_chunk(received[0], owned=True), pa.Buffer)   # small
    big = _received(_values(1100, 4000, "big"))[0]                               # 4.4 MB
    assert isinstance(blob_chunks.column_chunk(big, owned=True), blob_chunks.ColumnChunk)
    assert isinstance(blob_chunks.column_chunk(big, owned=False), pa.Buffer)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_column_chunks_write_the_bytes_serialize_chunk_buffer_makes(tmp_path, monkeypatch,
                                                                     direct):
    """ColumnChunks (serialised when written: into two reused slots by O_DIRECT, one written
    while the next is serialised; into memory of their own beyond the slots' size, or when
    written buffered) among chunks given as bytes and buffers, in one group commit: on disk
    exactly what serialize_chunk_buffer makes, read back from memory and after reopening."""
    monkeypatch.setattr(blob_writes, "SLOT_BYTES", 256 << 10)
    b = _open(str(tmp_path / "blobs"), direct, monkeypatch)
    arrays = [_received(a)[0] for a in (_values(60, 2900, "big0"), _values(60, 2900, "big1"),
                                        _values(3, 500, "small"),
                                        _values(120, 2900, "over-slot"),
                                        _values(60, 2900, "big2"))]
    given = [_values(40, 2900, "buffer"), _values(2, 300, "bytes")]
    chunks = [blob_chunks.ColumnChunk(a) for a in arrays]
    keys = [b.append(c) for c in chunks[:2]] + [b.append(serialize_chunk_buffer(given[0]))] + \
        [b.append(c) for c in chunks[2:4]] + [b.append(serialize_chunk_buffer(given[1])
                                                       .to_pybytes())] + [b.append(chunks[4])]
    order = arrays[:2] + given[:1] + arrays[2:4] + given[1:] + arrays[4:]
    assert sum(isinstance(p.chunk, blob_chunks.ColumnChunk) for p in b._pending) == \
        (4 if direct else 5)
    b.sync()
    with open(b._path(b._segment), "rb") as f:
        for key, values in zip(keys, order):
            _, offset, length = map(int, key.split(":"))
            assert os.pread(f.fileno(), length, offset) == \
                serialize_chunk_buffer(values).to_pybytes(), key
            if direct and length >= blob_chunks.IN_PLACE_MIN_BYTES:
                assert offset % ALIGN == 0
    _check(b, keys, order)
    _check(BlobStore(str(tmp_path / "blobs")), keys, order)
    more = _received(_values(60, 2900, "next"))          # the slots are reused
    key = b.append(blob_chunks.ColumnChunk(more[0]))
    b.sync()
    _check(b, [key], more)
    _check(BlobStore(str(tmp_path / "blobs")), keys + [key], order + more)


def test_a_failed_column_chunk_write_is_cut_off(tmp_path, monkeypatch):
    b = _open(str(tmp_path / "blobs"), True, monkeypatch)
    first = _received(_values(100, 7000, "ok"))
    key = b.append(blob_chunks.ColumnChunk(first[0]))
    b.sync()
    path = b._path(b._segment)
    size = os.path.getsize(path)
    writes = []
    real = blob_files.pwrite_all

    def second_fails(fd, view, offset):
        writes.append(offset)
        if len(writes) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, view, offset)

    monkeypatch.setattr(blob_writes, "pwrite_all", second_fails)
    for values in _received(*[_values(100, 7000, f"lost{j}") for j in range(4)]):
        b.append(blob_chunks.ColumnChunk(values))
    with pytest.raises(StorageError, match="cannot write blob segment"):
        b.sync()
    assert os.path.getsize(path) == size and not b._pending
    monkeypatch.undo()
    again = _received(_values(100, 7000, "again"))
    key2 = b.append(blob_chunks.ColumnChunk(again[0]))
    b.sync()
    _check(b, [key, key2], first + again)
    _check(BlobStore(str(tmp_path / "blobs")), [key, key2], first + again)


def test_received_values_are_kept_as_they_came_only_where_they_are_most_of_the_batch(tmp_path):
    """A column kept in memory as received keeps the whole batch's buffer: so it is, where the
    chunks of that batch are most of it; otherwise the values kept are a copy."""
    b = BlobStore(str(tmp_path / "blobs"))
    wide = _received(_values(50, 3000, "a"), _values(50, 3000, "b"), pa.array(range(50)))
    narrow = _received(_values(50, 3000, "c"), pa.array(["x" * 20000] * 50))
    keys = [b.append(blob_chunks.ColumnChunk(c)) for c in (wide[0], wide[1], narrow[0])]
    b.sync()

    def held(key):
        return b._recent[tuple(map(int, key.split(":")))][0]

    body = {buf.parent.address for buf in wide[0].buffers() if buf is not None}
    assert {buf.parent.address for buf in held(keys[0]).buffers() if buf is not None} == body
    assert all(buf.parent is None or buf.parent.address not in {
        p.parent.address for p in narrow[0].buffers() if p is not None}
        for buf in held(keys[2]).buffers() if buf is not None)
    _check(b, keys, [wide[0], wide[1], narrow[0]])


def test_a_callers_arrays_changed_after_the_put_do_not_change_what_was_stored(tmp_path):
    """An embedded put of arrays over the caller's numpy memory serialises them at once: the
    caller may reuse that memory as soon as the put returns."""
    import numpy as np
    floats = np.arange(40 * 1024, dtype=np.float32)
    offsets = pa.array(np.arange(0, 41 * 1024, 1024, dtype=np.int32))
    values = pa.ListArray.from_arrays(offsets, pa.array(floats))       # zero-copy over floats
    with store.connect(str(tmp_path / "x.duckdb")) as s:
        s.create_table("t", {"v": "list<float32>"}, storage={"v": "ref"})
        s.put("t", pa.table({"sample_id": [f"a_0_{i}" for i in range(40)], "v": values}))
        floats[:] = -1.0
        got = s.query("SELECT v FROM t ORDER BY trajectory_id").column("v").to_pylist()
    assert got == [list(np.arange(i * 1024, (i + 1) * 1024, dtype=np.float32)) for i in range(40)]


def test_o_direct_refused_at_write_falls_back_and_remembers(tmp_path, monkeypatch):
    b = _open(str(tmp_path / "blobs"), True, monkeypatch)
    calls = []

    def refused(self, path, pieces, start, total, durable_end):
        calls.append(start)
        # Part of the batch reached the file before the refusal: the rewrite must cover it.
        with open(path, "ab") as f:
            f.write(b"\xff" * 5000)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(SegmentWriter, "_write_direct", refused)
    arrays = [_values(100, 7000, "a"), _values(3, 100, "a-small"), _values(100, 7000, "a2")]
    keys = _put(b, arrays, buffer=True)       # placed for in-place writes, rewritten buffered
    assert calls and not b.direct_io
    more = [_values(100, 7000, "b")]
    keys2 = _put(b, more)
    assert len(calls) == 1                          # not tried again
    _check(b, keys + keys2, arrays + more)
    _check(BlobStore(str(tmp_path / "blobs")), keys + keys2, arrays + more)


def test_filesystem_refusing_o_direct_gets_the_buffered_path(monkeypatch, tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    root = os.path.join(shm, f"expstore-test-{os.getpid()}-{random.getrandbits(32)}")
    try:
        b = BlobStore(root, direct_io=True)
        if b.direct_io:
            pytest.skip("/dev/shm takes O_DIRECT here")
        arrays = [_values(100, 7000, "t")]
        keys = _put(b, arrays)
        assert int(keys[0].split(":")[1]) == 0
        _check(b, keys, arrays)
        assert sorted(os.listdir(root)) == ["seg-00000000.arrow"]       # no probe file left
    finally:
        for name in os.listdir(root) if os.path.isdir(root) else []:
            os.remove(os.path.join(root, name))
        if os.path.isdir(root):
            os.rmdir(root)


def test_o_direct_refused_at_open_is_detected_once(tmp_path, monkeypatch):
    tried = []
    real_open = os.open

    def no_direct(path, flags, *args, **kw):
        if flags & blob_files.O_DIRECT:
            tried.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    if blob_files.O_DIRECT is None:
        pytest.skip("no O_DIRECT on this platform")
    monkeypatch.setattr(blob_files.os, "open", no_direct)
    b = BlobStore(str(tmp_path / "blobs"), direct_io=True)
    assert not b.direct_io and len(tried) == 1
    arrays = [_values(100, 7000, "r")]
    keys = _put(b, arrays) + _put(b, arrays)
    assert len(tried) == 1 and int(keys[1].split(":")[1]) == int(keys[0].split(":")[2])
    monkeypatch.undo()
    _check(b, keys, arrays + arrays)
    assert os.listdir(tmp_path / "blobs") == ["seg-00000000.arrow"]


def test_the_probe_leaves_no_file(tmp_path, monkeypatch):
    _open(str(tmp_path / "blobs"), True, monkeypatch)
    assert os.listdir(tmp_path / "blobs") == []


# -- segments written by the code before O_DIRECT ------------------------------------------------
def _old_serialize_chunk(values: pa.Array) -> bytes:
    # store/blobs.py before O_DIRECT (git show efd1e4f:store/blobs.py), verbatim
    sink = io.BytesIO()
    batch = pa.record_batch([values], names=["v"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    body = sink.getvalue()
    return zlib.crc32(body).to_bytes(4, "little") + body


def _old_write(root: str, segment: int, size: int, chunks: list[bytes]) -> list[str]:
    """The old append + sync: keys from the running size, one O_APPEND write, fsync."""
    keys = []
    for c in chunks:
        keys.append(f"{segment}:{size}:{len(c)}")
        size += len(c)
    os.makedirs(root, exist_ok=True)
    fd = os.open(f"{root}/seg-{segment:08d}.arrow", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                 0o644)
    try:
        os.write(fd, b"".join(chunks))
        os.fsync(fd)
    finally:
        os.close(fd)
    return keys


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_old_unpadded_segments_read_and_get_appended_to(tmp_path, monkeypatch, direct):
    root = str(tmp_path / "blobs")
    old_a = [_values(7, 901, "oa"), _values(3, 1203, "ob")]
    keys_a = _old_write(root, 0, 0, [_old_serialize_chunk(a) for a in old_a])
    old_b = [_values(11, 555, "oc")]
    keys_b = _old_write(root, 0, os.path.getsize(f"{root}/seg-00000000.arrow"),
                        [_old_serialize_chunk(a) for a in old_b])
    old_size = os.path.getsize(f"{root}/seg-00000000.arrow")
    assert old_size % ALIGN != 0
    b = _open(root, direct, monkeypatch)
    _check(b, keys_a + keys_b, old_a + old_b)
    new = [_values(200, 4000, "n")]
    keys_n = _put(b, new)
    start = int(keys_n[0].split(":")[1])
    assert start == (-(-old_size // ALIGN) * ALIGN if direct else old_size)
    _check(b, keys_a + keys_b + keys_n, old_a + old_b + new)
    _check(BlobStore(root), keys_a + keys_b + keys_n, old_a + old_b + new)


def test_object_store_writes_the_pieces(tmp_path):
    (tmp_path / "bucket").mkdir()
    fs = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())
    b = BlobStore("blobs", fs)
    arrays = [_values(5, 900, "x"), _values(9, 700, "y")]
    keys = _put(b, arrays, buffer=True) + _put(b, arrays)
    (s0, o0), (s1, o1), (s2, o2), (s3, o3) = [map(int, k.split(":")[:2]) for k in keys]
    # One immutable object per group commit, no alignment, no padding.
    assert s0 == s1 and s2 == s3 == s0 + 1 and o0 == o2 == 0
    assert o1 == o3 == int(keys[0].split(":")[2])
    _check(b, keys, arrays + arrays)


# -- kill -9 in the middle of big O_DIRECT group commits -----------------------------------------
CHILD = textwrap.dedent("""
    import sys
    import store

    path, run = sys.argv[1], int(sys.argv[2])
    s = store.connect(path)
    s.create_table("t", {"response": "string", "ids": "list<int32>"}, if_not_exists=True)
    print("READY", flush=True)
    i = 0
    while True:
        sids = [f"r{run}q{i}x{k}_0_0" for k in range(40)]
        s.put("t", {"sample_id": sids,
                    "response": [f"{sid}:" + "z" * (9000 + k) for k, sid in enumerate(sids)],
                    "ids": [list(range(i % 50, i % 50 + 1500)) for _ in sids]})
        print("W " + ",".join(sids), flush=True)
        i += 1
""")


def _expected(sid: str) -> tuple[str, list[int]]:
    i = int(sid.split("q", 1)[1].split("x", 1)[0])
    k = int(sid.split("x", 1)[1].split("_", 1)[0])
    return f"{sid}:" + "z" * (9000 + k), list(range(i % 50, i % 50 + 1500))


def _run_and_kill(path: str, run: int, kill_after: int, direct: bool) -> set[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               EXPSTORE_BLOB_DIRECT_IO="1" if direct else "0")
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, str(run)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written: set[str] = set()
    lines = 0
    deadline = time.monotonic() + 60
    try:
        while lines < kill_after:
            assert time.monotonic() < deadline, f"only {lines} lines from the child in 60 s"
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            if not ready:
                continue
            line = child.stdout.readline()
            assert line, f"the child exited early: {child.stderr.read()[-2000:]}"
            kind, _, rest = line.strip().partition(" ")
            if kind == "W":
                written.update(rest.split(","))
            lines += 1
        # Kill at a random moment, often in the middle of the next write.
        time.sleep(random.random() * 0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return written


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_kill9_during_big_blob_writes_loses_nothing_acknowledged(tmp_path, monkeypatch, direct):
    if direct and not blob_files.probe_direct(str(tmp_path)):
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    path = str(tmp_path / "crash.duckdb")
    rng = random.Random(7)
    all_written: set[str] = set()
    for run in range(3):
        all_written |= _run_and_kill(path, run, rng.randint(3, 12), direct)
        with store.connect(path) as s:
            rows = s.query("SELECT * FROM t").to_pylist()
            by_id = {r["sample_id"]: r for r in rows}
            missing = all_written - set(by_id)
            assert not missing, f"acknowledged writes lost after kill -9: {sorted(missing)[:3]}"
            for sid in all_written:
                assert (by_id[sid]["response"], by_id[sid]["ids"]) == _expected(sid), sid


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_torn_tail_is_skipped_after_reopen(tmp_path, monkeypatch, direct):
    """A crash in the middle of a write leaves bytes no key points to; the next writer starts
    after them (aligned with O_DIRECT) and both old and new keys read."""
    root = str(tmp_path / "blobs")
    b = _open(root, direct, monkeypatch)
    first = [_values(100, 7000, "f")]
    keys = _put(b, first)
    path = b._path(b._segment)
    with open(path, "ab") as f:
        f.write(serialize_chunk_buffer(_values(100, 7000, "torn"))[:12345])
    torn_end = os.path.getsize(path)
    b = _open(root, direct, monkeypatch)
    new = [_values(100, 7000, "n")]
    keys2 = _put(b, new)
    start = int(keys2[0].split(":")[1])
    assert start >= torn_end and (start % ALIGN == 0 if direct else start == torn_end)
    _check(b, keys + keys2, first + new)
