"""Hybrid storage: large or ``storage="ref"`` values go to blob segments beside the database;
claims and ``SELECT *`` resolve them; ``gc()`` deletes only unreferenced segments."""
from __future__ import annotations

import os

import numpy as np
import pyarrow.fs as pafs
import pytest

import store.blobs
from store import tensors

COLUMNS = {"prompt": "string", "response": "string", "ids": "list<int32>",
           "t": "tensor<float32>", "note": "string", "reward": "float64"}
BIG = "x" * 2000                     # above the default 512-byte threshold
IDS = list(range(300))               # 1,200 bytes of int32


def _segments(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.startswith("seg-"))


def _write(s, table="t", prefix="a", n=2):
    arrays = [np.arange(400, dtype=np.float32).reshape(20, 20), np.ones(2, np.float32)]
    sids = [f"{prefix}_0_{i}" for i in range(n)]
    s.put(table, {"sample_id": sids,
                  "prompt": ["p"] * n,
                  "response": [BIG if i % 2 == 0 else "short" for i in range(n)],
                  "ids": [IDS if i % 2 == 0 else [1] for i in range(n)],
                  "t": tensors.to_arrow([arrays[i % 2] for i in range(n)]),
                  "note": [f"n{i}" for i in range(n)],
                  "reward": [float(i) for i in range(n)]})
    return sids


def _check_resolved(table) -> None:
    rows = {r["sample_id"]: r for r in table.drop_columns(["t"]).to_pylist()}
    tens = dict(zip(table.column("sample_id").to_pylist(), tensors.to_numpy(table.column("t"))))
    for sid, row in rows.items():
        i = int(sid.rsplit("_", 1)[1])
        assert row["response"] == (BIG if i % 2 == 0 else "short")
        assert row["ids"] == (IDS if i % 2 == 0 else [1])
        assert row["note"] == f"n{i}"
        assert tens[sid].shape == ((20, 20) if i % 2 == 0 else (2,))
    assert not any(c.endswith("__ref") for c in table.column_names)


def test_large_and_ref_values_go_to_blob_dir(embedded_store, db_path):
    s = embedded_store
    s.create_table("t", COLUMNS, storage={"note": "ref"})
    _write(s)
    blob_dir = db_path + ".blobs"
    assert _segments(blob_dir), "no blob segment was written"
    # In DuckDB the big values are NULL with a key beside them; small ones are inline. (The
    # store's own reader sees the tables as stored; SQL sees the values, see below.)
    raw = {r[0]: r[1:] for r in s._readers.cursor().execute(
        "SELECT sample_id, response IS NULL, response__ref, ids__ref, t__ref, note IS NULL, "
        "note__ref FROM t").fetchall()}
    r_null, r_key, ids_key, t_key, _, _ = raw["a_0_0"]
    assert r_null and r_key and ids_key and t_key
    r_null, r_key, ids_key, t_key, _, _ = raw["a_0_1"]
    assert not r_null and r_key is None and ids_key is None and t_key is None
    # storage="ref" sends even tiny values by reference.
    assert all(n_null and note_key for *_, n_null, note_key in raw.values())
    # SQL shows the keys, and every value where it is stored.
    seen = {r["sample_id"]: r for r in s.query(
        "SELECT sample_id, response__ref, length(response) AS n, note FROM t").to_pylist()}
    assert seen["a_0_0"]["response__ref"] == raw["a_0_0"][1]
    assert [seen[i]["n"] for i in ("a_0_0", "a_0_1")] == [len(BIG), len("short")]
    assert [seen[i]["note"] for i in ("a_0_0", "a_0_1")] == ["n0", "n1"]


def test_reads_resolve_references(embedded_store):
    s = embedded_store
    s.create_table("t", COLUMNS, storage={"note": "ref"})
    _write(s, n=4)
    _check_resolved(s.query("SELECT * FROM t"))
    claim = s.claim("t", 10)
    assert claim.num_rows == 4
    _check_resolved(claim.data)
    s.ack(claim.claim_id)
    _check_resolved(s.query("SELECT * FROM t WHERE consumed"))


def test_ref_threshold_option(open_store):
    s = open_store(ref_threshold=10_000)
    s.create_table("t", {"response": "string"})
    s.put("t", {"sample_id": ["a_0_0"], "response": [BIG]})
    assert s.query("SELECT response__ref FROM t").column(0).to_pylist() == [None]
    assert s.query("SELECT length(response) FROM t").column(0).to_pylist() == [len(BIG)]


def test_storage_value_keeps_big_values_inline(embedded_store):
    s = embedded_store
    s.create_table("t", {"response": "string"}, storage={"response": "value"})
    s.put("t", {"sample_id": ["a_0_0"], "response": [BIG]})
    assert "response__ref" not in s.query("SELECT * FROM t").column_names
    assert s.query("SELECT length(response) FROM t").column(0).to_pylist() == [len(BIG)]


def test_by_value_columns_filter_in_sql(embedded_store):
    s = embedded_store
    s.create_table("t", COLUMNS)
    _write(s, n=6)
    got = s.query("SELECT sample_id FROM t WHERE reward >= 3 AND input_id = 'a' "
                  "ORDER BY sample_id").column(0).to_pylist()
    assert got == ["a_0_3", "a_0_4", "a_0_5"]
    claim = s.claim("t", 10, where="reward >= 4")
    assert claim.data.column("sample_id").to_pylist() == ["a_0_4", "a_0_5"]
    _check_resolved(claim.data)


def test_references_survive_reopen(open_store, db_path):
    s = open_store()
    s.create_table("t", COLUMNS)
    _write(s, n=4)
    s.close()
    s = open_store()
    _check_resolved(s.query("SELECT * FROM t"))
    _check_resolved(s.claim("t", 10).data)


def test_gc_removes_only_unreferenced_segments(open_store, db_path, monkeypatch):
    # Small segments so that each write lands in a segment of its own.
    s = open_store(blob_segment_bytes=1024)
    s.create_table("t", COLUMNS)
    s.create_table("keep", COLUMNS)
    blob_dir = db_path + ".blobs"
    _write(s, "t", "a")
    _write(s, "t", "b")
    _write(s, "keep", "k")
    _write(s, "t", "c")           # the keep table's segment is not the one being written
    before = _segments(blob_dir)
    assert len(before) >= 3
    # Nothing is unreferenced yet (the last segment is the one being written anyway).
    assert s.gc()["segments_removed"] == 0
    assert _segments(blob_dir) == before

    s.drop_table("t")
    result = s.gc()
    after = _segments(blob_dir)
    assert result["segments_removed"] >= 1 and result["bytes_freed"] > 0
    assert len(after) == len(before) - result["segments_removed"]
    _check_resolved(s.query("SELECT * FROM keep"))
    assert s.gc()["segments_removed"] == 0               # idempotent
    s.close()
    _check_resolved(open_store().query("SELECT * FROM keep"))


def test_object_store_mode(open_store, tmp_path):
    """A non-local filesystem writes one immutable segment per group commit."""
    root = tmp_path / "bucket"
    root.mkdir()
    fs = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
    s = open_store(blob_dir="blobs", blob_filesystem=fs)
    s.create_table("t", COLUMNS)
    s.create_table("keep", COLUMNS)
    _write(s, "t", "a")
    _write(s, "keep", "k")
    _write(s, "t", "b")
    assert len(_segments(str(root / "blobs"))) == 3
    _check_resolved(s.claim("keep", 10).data)
    s.drop_table("t")
    assert s.gc()["segments_removed"] == 2
    assert len(_segments(str(root / "blobs"))) == 1
    _check_resolved(s.query("SELECT * FROM keep"))


def test_disk_bytes_counts_an_object_stores_segments(open_store, tmp_path):
    """What /metrics shows as the blob store's bytes (the local case: the metrics tests)."""
    root = tmp_path / "bucket"
    root.mkdir()
    fs = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
    s = open_store(blob_dir="blobs", blob_filesystem=fs)
    s.create_table("t", COLUMNS)
    _write(s, "t", "a")
    _write(s, "t", "b")
    on_disk = sum(p.stat().st_size for p in (root / "blobs").glob("seg-*.arrow"))
    assert on_disk > 0 and s.disk_bytes()["blobs"] == on_disk
