"""Row-range reads of blob chunks (format 3, store/blob_rows.py): the values read back are the
ones put, for every type the layout handles, for any subset of rows, across segments and after
reopening; damage is refused; a read of a few rows reads a bounded number of bytes; segments of
the format before (tests/fixtures/blobs-exb2) still read."""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pyarrow as pa
import pytest

import store
from store import blob_rows, tensors
from store.blob_keys import keys_for
from store.blob_chunks import serialize_chunk_buffer
from store.blobs import BlobStore
from store.errors import StorageError
from store.row_cut import RowCut

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "blobs-exb2")


def _columns(n: int, seed: int = 1) -> dict[str, pa.Array]:
    rng = np.random.default_rng(seed)
    return {
        "text": pa.array([f"t{i}:" + "é" * (i % 7) + "x" * (100 + i * 40) for i in range(n)],
                         pa.large_string()),
        "short": pa.array([f"s{i}:" * (i % 50) for i in range(n)], pa.string()),
        "blob": pa.array([bytes(rng.integers(0, 256, 100 + i, dtype=np.uint8)) for i in range(n)],
                         pa.large_binary()),
        "ids": pa.array([list(range(i, i + 50 + i * 10)) for i in range(n)], pa.list_(pa.int32())),
        "logp": pa.array([(-rng.random(30 + i * 7)).astype(np.float32).tolist() if i % 9 else None
                          for i in range(n)], pa.list_(pa.float32())),
        "tensor": tensors.to_arrow([rng.standard_normal((i % 3 + 1, 64)).astype(np.float32)
                                    if i % 5 else None for i in range(n)]),
        "bools": pa.array([[bool(j % 3) for j in range(i % 40)] for i in range(n)],
                          pa.large_list(pa.bool_())),
        "fixed": pa.array([[float(i)] * 100 for i in range(n)], pa.list_(pa.float64(), 100)),
        "nested": pa.array([[["a" * j] * (j % 3) for j in range(i % 13)] for i in range(n)],
                           pa.list_(pa.list_(pa.string()))),
    }


def _write(b: BlobStore, columns: dict[str, pa.Array]) -> dict[str, str]:
    keys = {}
    for name, arr in columns.items():
        chunk = serialize_chunk_buffer(arr)
        assert chunk.to_pybytes()[:4] == b"EXB3", name
        keys[name] = b.append(chunk)
    b.sync()
    return keys


def _resolve(b: BlobStore, key: str, rows: list[int], typ: pa.DataType) -> pa.Array:
    return b.resolve([f"{key}:{r}" for r in rows], typ)


@pytest.mark.parametrize("recent", [256 << 20, 0], ids=["from_memory", "from_segments"])
def test_any_rows_read_back_as_put(tmp_path, recent):
    n = 300
    cols = _columns(n)
    b = BlobStore(str(tmp_path / "blobs"), recent_bytes=recent)
    keys = _write(b, cols)
    rnd = random.Random(7)
    for trial in range(120):
        k = rnd.randint(1, 40)
        if trial % 3 == 0:
            rows = rnd.sample(range(n), k)               # scattered, any order
        elif trial % 3 == 1:
            start = rnd.randrange(n - k)
            rows = list(range(start, start + k))         # a run, as claims mostly are
        else:
            rows = sorted(rnd.sample(range(n), k)) * 2   # repeated keys
        for name, arr in cols.items():
            got = _resolve(b, keys[name], rows, arr.type)
            got.validate(full=True)
            assert got.equals(arr.take(pa.array(rows))), (name, rows)


def test_nulls_between_keys_and_keys_across_segments_after_reopen(tmp_path):
    root = str(tmp_path / "blobs")
    b = BlobStore(root)
    first = _columns(64, seed=2)["ids"]
    k1 = _write(b, {"ids": first})["ids"]
    b.roll()
    second = _columns(64, seed=3)["ids"]
    k2 = _write(b, {"ids": second})["ids"]
    assert k1.split(":")[0] != k2.split(":")[0]
    keys = [f"{k2}:5", None, f"{k1}:63", f"{k1}:0", None, f"{k2}:40"]
    expected = pa.array([second[5].as_py(), None, first[63].as_py(), first[0].as_py(), None,
                         second[40].as_py()], first.type)
    assert b.resolve(keys, first.type).equals(expected)
    b.close()
    assert BlobStore(root).resolve(keys, first.type).equals(expected)


def test_fresh_chunks_are_read_from_memory_within_their_bound(tmp_path):
    cols = _columns(200)
    b = BlobStore(str(tmp_path / "blobs"), recent_bytes=300_000)
    keys = _write(b, cols)
    sizes = {name: int(key.split(":")[2]) for name, key in keys.items()}
    assert b._recent_held <= 300_000 < sum(sizes.values())
    held = {k for k in b._recent}
    newest = (*map(int, keys["nested"].split(":")),)
    assert newest in held                                   # the newest stay
    for name, arr in cols.items():                          # held or not, all read the same
        assert _resolve(b, keys[name], [3, 150, 77], arr.type).equals(arr.take([3, 150, 77]))


def test_a_few_rows_of_a_large_chunk_read_a_bounded_number_of_bytes(tmp_path):
    n, width = 4096, 1024
    values = pa.ListArray.from_arrays(
        pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32)),
        pa.array(np.arange(n * width, dtype=np.float32)))
    b = BlobStore(str(tmp_path / "blobs"), recent_bytes=0)   # read from the segment
    key = _write(b, {"v": values})["v"]
    read: list[int] = []
    preader = b._preader

    def counting(segment):
        pread = preader(segment)

        def counted(offset, length):
            read.append(length)
            return pread(offset, length)
        return counted

    b._preader = counting                                  # type: ignore[method-assign]
    b.resolve([f"{key}:0"], values.type)                   # the index, read once
    read.clear()
    rows = list(range(1000, 1016))
    got = _resolve(b, key, rows, values.type)
    assert got.equals(values.slice(1000, 16))
    index = b._index(*map(int, key.split(":")))
    assert index is not None
    row_bytes = width * 4
    # the rows themselves, and at most the rest of the blocks holding them
    assert sum(read) <= (16 + 2 * index.block_rows) * (row_bytes + 4) + 64
    assert sum(read) < values.nbytes // 50


def test_damaged_values_are_refused_not_served(tmp_path):
    cols = _columns(200)
    b = BlobStore(str(tmp_path / "blobs"))
    keys = _write(b, {"text": cols["text"]})
    segment, offset, length = map(int, keys["text"].split(":"))
    index = b._index(segment, offset, length)
    assert index is not None
    data_at, data_len = index.buffers[2]                   # the strings' bytes
    with open(b._path(segment), "r+b") as f:
        f.seek(offset + data_at + data_len - 10)           # inside the last row's value
        byte = f.read(1)
        f.seek(offset + data_at + data_len - 10)
        f.write(bytes([byte[0] ^ 4]))
    fresh = BlobStore(str(tmp_path / "blobs"))
    assert _resolve(fresh, keys["text"], [0, 1, 2], cols["text"].type).equals(
        cols["text"].slice(0, 3))                          # other blocks still read
    with pytest.raises(StorageError, match="is corrupt: block .* does not match its checksum"):
        _resolve(fresh, keys["text"], [199], cols["text"].type)


def test_format_2_segments_written_before_still_read(tmp_path):
    root = str(tmp_path / "blobs")
    shutil.copytree(FIXTURE, root)
    expected = pa.ipc.open_file(os.path.join(root, "expected.arrow")).read_all()
    b = BlobStore(root)
    for name in ("text", "blob", "ids", "logp", "tensor"):
        key = expected.column(f"{name}__key")[0].as_py()
        values = expected.column(name).combine_chunks()
        assert b._index(*map(int, key.split(":"))) is None    # read as format 2
        assert _resolve(b, key, list(range(len(values))), values.type).equals(values)
        assert _resolve(b, key, [7, 3, 30], values.type).equals(values.take([7, 3, 30]))
    # a store appends format-3 chunks after them, and both read
    new = _columns(20)["ids"]
    k = _write(b, {"ids": new})["ids"]
    assert _resolve(b, k, list(range(20)), new.type).equals(new)


def test_types_the_layout_cannot_cut_are_written_whole():
    values = pa.array(["a" * 600, "b" * 600], pa.string()).dictionary_encode()
    assert not blob_rows.supported(values.type)
    assert serialize_chunk_buffer(values).to_pybytes()[:4] == b"EXB2"


def test_claims_and_sql_return_the_values_put(open_store, db_path):
    cols = _columns(100)
    s = open_store()
    s.create_table("t", {name: _spelling(a.type) for name, a in cols.items()
                         if name in ("text", "blob", "ids", "logp", "tensor")},
                   storage={"text": "ref", "blob": "ref", "ids": "ref", "logp": "ref",
                            "tensor": "ref"})
    names = ["text", "blob", "ids", "logp", "tensor"]
    data = pa.table({"sample_id": [f"{i // 4}_0_{i % 4}" for i in range(100)],
                     **{n: cols[n] for n in names}})
    s.put("t", data.slice(0, 60))
    s.put("t", data.slice(60))
    by_id = {sid: i for i, sid in enumerate(data.column("sample_id").to_pylist())}

    def check(table: pa.Table) -> None:
        rows = [by_id[sid] for sid in table.column("sample_id").to_pylist()]
        for n in names:
            expected = cols[n].take(pa.array(rows))
            assert table.column(n).combine_chunks().cast(expected.type).equals(expected), n

    c = s.claim("t", 16)
    check(c.data)
    s.ack(c.claim_id)
    # rows whose logp or tensor is null are not ready (required columns): 71 of 100 are
    c = s.claim("t", 48)                                      # crosses the two puts
    assert c.data.num_rows == 48
    check(c.data)
    check(s.query("SELECT * FROM t WHERE sample_id LIKE '1%'"))
    s.close()
    s = open_store()                                          # after reopening
    check(s.query("SELECT * FROM t"))


def _spelling(t: pa.DataType) -> str:
    if pa.types.is_large_string(t):
        return "string"
    if pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_struct(t):
        return "tensor<float32>"
    return f"list<{t.value_type}>".replace("<float>", "<float32>")


def test_rows_of_a_cached_put_are_cut_by_row_number(tmp_path):
    cols = _columns(120)
    b = BlobStore(str(tmp_path / "blobs"))
    keys = _write(b, cols)
    rnd = random.Random(3)
    names = list(cols)
    source = pa.table({n: keys_for(keys[n], len(cols[n])) for n in names})
    for rows in (list(range(10, 26)), rnd.sample(range(len(cols["ids"])), 16), [5]):
        got = b.put_columns(source, list(range(len(names))), RowCut(rows),
                            [cols[n].type for n in names])
        for name, column in zip(names, got):   # every column of the put, in one call
            assert column is not None and column.equals(cols[name].take(rows)), (name, rows)
    arr = cols["ids"]
    shuffled = pa.table({"k": keys_for(keys["ids"], len(arr)).take(list(range(len(arr)))[::-1])})
    with_null = pa.table({"k": pa.array([f"{keys['ids']}:{i}" if i else None
                                         for i in range(len(arr))], pa.large_string())})
    other = BlobStore(str(tmp_path / "other"), recent_bytes=0)
    cold = _write(other, {"ids": arr})["ids"]
    for b_, source in ((b, shuffled), (b, with_null),
                       (other, pa.table({"k": keys_for(cold, len(arr))}))):
        # keys not naming one chunk's rows in order, or a chunk not in memory: resolve them
        assert b_.put_columns(source, [0], RowCut([1, 2]), [arr.type]) == [None]


def test_a_claim_of_a_fresh_put_cuts_its_values_without_resolving_keys(tmp_path, monkeypatch):
    s = store.connect(str(tmp_path / "x.duckdb"))
    n = 64
    values = pa.array([[float(i)] * 256 for i in range(n)], pa.list_(pa.float32()))
    text = pa.array([f"r{i}:" + "x" * 500 for i in range(n)], pa.large_string())
    s.create_table("t", {"v": "list<float32>", "text": "string"},
                   storage={"v": "ref", "text": "ref"})
    s.put("t", pa.table({"sample_id": [f"q{i}_0_0" for i in range(n)], "v": values,
                         "text": text}))
    resolved = []
    real = BlobStore.resolve
    monkeypatch.setattr(BlobStore, "resolve",
                        lambda self, keys, typ: resolved.append(len(keys)) or real(self, keys, typ))
    got = []
    while (c := s.claim("t", 16)).data.num_rows:
        got.append(c.data)
        s.ack(c.claim_id)
    data = pa.concat_tables(got)
    by_id = {sid: i for i, sid in enumerate(data.column("sample_id").to_pylist())}
    order = [by_id[f"q{i}_0_0"] for i in range(n)]
    assert data.column("v").take(order).to_pylist() == values.to_pylist()
    assert data.column("text").take(order).to_pylist() == text.to_pylist()
    assert resolved == []
    s.close()


@pytest.mark.parametrize("recent", [256 << 20, 0], ids=["from_memory", "from_segments"])
def test_a_run_of_one_chunks_keys_is_resolved_in_bulk(tmp_path, recent):
    cols = _columns(150)
    b = BlobStore(str(tmp_path / "blobs"), recent_bytes=recent)
    keys = _write(b, cols)
    for name, arr in cols.items():
        for first, n in ((0, 150), (37, 64), (149, 1)):
            run = pa.array([f"{keys[name]}:{r}" for r in range(first, first + n)], pa.string())
            got = b.resolve_keys(run, arr.type)
            if n < 2:
                assert got is None                       # nothing to gain: resolve it
                continue
            assert got is not None and got.equals(arr.slice(first, n)), (name, first)
    prefix = keys["ids"]
    seg, off, length = prefix.split(":")
    for odd in ([f"{prefix}:{r}" for r in (0, 2, 1)],             # not in order
                [f"{prefix}:0", None, f"{prefix}:2"],              # a null
                [f" {prefix}:{r}" for r in range(3)],              # spelled otherwise
                [f"{seg}:{off}:+{length}:{r}" for r in range(3)],
                [f"-{prefix}:{r}" for r in range(3)],
                ["x", "y", "z"]):
        assert b.resolve_keys(pa.array(odd, pa.string()), cols["ids"].type) is None, odd


def test_a_run_of_keys_is_checked_in_either_string_type_and_at_any_offset(tmp_path):
    """The bulk path's check of a run of keys (compared as bytes): the keys as DuckDB gives
    them (string) or as the writer builds them (large_string), sliced out of a longer array, and
    runs spelled otherwise at the same lengths, which it must refuse."""
    cols = _columns(150)
    b = BlobStore(str(tmp_path / "blobs"))
    prefix = _write(b, cols)["ids"]
    arr = cols["ids"]
    for typ in (pa.string(), pa.large_string()):
        keys = keys_for(prefix, 150).cast(typ)
        for first, n in ((0, 150), (37, 64), (140, 10), (1, 2)):
            got = b.resolve_keys(keys.slice(first, n), arr.type)
            assert got is not None and got.equals(arr.slice(first, n)), (typ, first, n)
        swapped = list(range(150))
        swapped[12], swapped[13] = 13, 12                 # same lengths, other characters
        for odd in (keys.take(swapped).slice(10, 20),
                    keys.slice(0, 20).take([0, 1, 2, 4, 3]),
                    pa.array([f"{prefix}:{r:03d}" for r in range(20)], typ),
                    pa.array([f"{prefix}:{r}" for r in (40, 41, 42, 43, 44, 45, 46, 47, 48, 94)],
                             typ),
                    pa.array([f"{prefix}:{r}" for r in range(60, 70)] + [f"{prefix}:7O"],
                             typ).slice(1)):
            assert b.resolve_keys(odd, arr.type) is None, (typ, odd.to_pylist())


def test_cut_rows_in_runs_is_a_take():
    from store.row_cut import MAX_RUNS, cut
    cols = _columns(120)
    rnd = random.Random(5)
    cases = [list(range(30, 46)),                                # one run: a slice
             list(range(80, 88)) + list(range(8, 16)),           # two runs, out of order
             [3, 4, 5, 3, 4, 5],                                  # a run twice
             [50, 49, 48],                                        # backwards: runs of one
             rnd.sample(range(120), MAX_RUNS + 3)]                # more runs than MAX_RUNS
    for name, arr in cols.items():
        chunked = pa.chunked_array([arr.slice(0, 70), arr.slice(70)])   # a column of two puts
        for rows in cases:
            expected = arr.take(pa.array(rows))
            for values in (arr, chunked):
                got = cut(values, rows)
                assert isinstance(got, pa.Array) and got.equals(expected), (name, rows)


def test_whole_chunk_accepts_only_the_keys_of_a_whole_chunk_in_order():
    """The check a claim relies on to cut a put's rows by row number (compared as bytes where
    the keys are one large_string array, in Arrow otherwise)."""
    from store.blob_keys import whole_chunk
    prefix = "3:8192:40960"
    keys = keys_for(prefix, 120)
    assert whole_chunk(pa.chunked_array([keys])) == (3, 8192, 40960)
    assert whole_chunk(pa.chunked_array([keys.cast(pa.string())])) == (3, 8192, 40960)
    assert whole_chunk(pa.chunked_array([keys.slice(0, 60), keys.slice(60)])) == (3, 8192, 40960)
    swapped = list(range(120))
    swapped[11], swapped[12] = 12, 11                   # same lengths, other characters
    bad = [keys.take(swapped),
           keys.slice(1),                                # starts at row 1
           keys.slice(0, 119),                           # (fine: rows 0 … 118)
           pa.array([f"{prefix}:{i:02d}" for i in range(120)], pa.large_string()),
           pa.array([f"{prefix}:{i}" for i in range(119)] + [f"{prefix}:200"], pa.large_string()),
           pa.array([f"3:8192:40961:{i}" if i == 7 else f"{prefix}:{i}" for i in range(120)],
                    pa.large_string())]
    got = [whole_chunk(pa.chunked_array([b])) for b in bad]
    assert got == [None, None, (3, 8192, 40960), None, None, None]
    sliced = keys_for(prefix, 121).slice(1)             # an offset into its buffers: in Arrow
    assert whole_chunk(pa.chunked_array([sliced])) is None
    assert whole_chunk(pa.chunked_array([keys_for(prefix, 130).slice(0, 120)])) == \
        (3, 8192, 40960)
