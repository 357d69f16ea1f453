"""GC frees the blob bytes of rows that are gone, at the default segment size."""
from __future__ import annotations

import os

import store


def _blob_bytes(db_path: str) -> int:
    d = f"{db_path}.blobs"
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def test_gc_after_drop_frees_the_dropped_tables_blobs_and_keeps_the_others(db_path):
    s = store.connect(db_path)
    try:
        s.create_table("gone", {"text": "string"}, storage={"text": "ref"})
        s.put("gone", {"sample_id": [f"q{i}_0_0" for i in range(20)], "text": ["x" * 5000] * 20})
        s.gc()  # the segment holding 'gone' is closed here; a new one is started
        s.create_table("kept", {"text": "string"}, storage={"text": "ref"})
        s.put("kept", {"sample_id": ["k_0_0"], "text": ["y" * 3000]})
        before = _blob_bytes(db_path)
        s.drop_table("gone")
        freed = s.gc()
        assert freed["segments_removed"] >= 1
        assert freed["bytes_freed"] >= 20 * 5000
        assert _blob_bytes(db_path) < before
        assert s.claim("kept", 1).data.column("text").to_pylist() == ["y" * 3000]
    finally:
        s.close()
