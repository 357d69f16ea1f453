"""The writer records which key columns of a cached put name one chunk's rows 0 … n-1 in order
(``RowWriter.with_blob_keys`` → ``BlobStore.know_whole``), so that a put's first claim cuts its
values from the chunk in memory without checking its keys again. A column marked whole that is
not would serve wrong values: puts written in one statement, and puts with null by-reference
values, must not be marked so."""
from __future__ import annotations

import pyarrow as pa

import store.blobs
from store.blob_keys import whole_chunk
from store.blobs import BlobStore
from test_store_small_puts import writer_held

COLUMNS = {"v": "list<float32>", "text": "string"}
STORAGE = {"v": "ref", "text": "ref"}


def _put(prefix: str, n: int, text_nulls: bool = False) -> pa.Table:
    return pa.table({
        "sample_id": [f"{prefix}{i}_0_0" for i in range(n)],
        "v": pa.array([[float(i), float(len(prefix))] * 128 for i in range(n)],
                      pa.list_(pa.float32())),
        "text": pa.array([None if text_nulls and i % 3 == 0 else f"{prefix}{i}:" + "x" * 500
                          for i in range(n)], pa.large_string())})


def _claim_all(s) -> dict[str, dict]:
    got: dict[str, dict] = {}
    while (c := s.claim("t", 16)).data.num_rows:
        for row in c.data.select(["sample_id", "v", "text"]).to_pylist():
            got[row.pop("sample_id")] = row
        s.ack(c.claim_id)
    return got


def _as_put(*tables: pa.Table) -> dict[str, dict]:
    return {row.pop("sample_id"): row
            for t in tables for row in t.select(["sample_id", "v", "text"]).to_pylist()}


def test_a_first_claim_of_a_put_does_not_check_its_keys(open_store, monkeypatch):
    s = open_store()
    s.create_table("t", COLUMNS, storage=STORAGE)
    data = _put("q", 64)
    s.put("t", data)
    checked, resolved = [], []
    monkeypatch.setattr(store.blobs, "whole_chunk",
                        lambda keys: checked.append(len(keys)) or whole_chunk(keys))
    real_resolve = BlobStore.resolve
    monkeypatch.setattr(BlobStore, "resolve", lambda self, keys, typ:
                        resolved.append(len(keys)) or real_resolve(self, keys, typ))
    assert _claim_all(s) == _as_put(data)
    # cut from the chunks in memory (nothing resolved), by the writer's marks (nothing checked)
    assert checked == [] and resolved == []


def test_puts_written_together_or_with_null_values_are_not_marked_whole(open_store,
                                                                        monkeypatch):
    s = open_store()
    s.create_table("t", COLUMNS, storage=STORAGE, required=["v"])
    marks: list[tuple[pa.Table, dict]] = []
    real_know = BlobStore.know_whole
    monkeypatch.setattr(BlobStore, "know_whole", lambda self, source, by_column: (
        marks.append((source, dict(by_column))), real_know(self, source, by_column))[-1])
    together = [_put("a", 32), _put("bb", 32)]            # bulk puts: one statement
    with writer_held(s):
        futures = [s.put_async("t", t) for t in together]
    for f in futures:
        f.result(30)
    with_nulls, alone = _put("ccc", 40, text_nulls=True), _put("dddd", 24)
    s.put("t", with_nulls)
    s.put("t", alone)
    by_rows = {source.num_rows: (source, m) for source, m in marks}
    assert set(by_rows) == {64, 40, 24}, "the two bulk puts should be written as one"
    for source, m in marks:
        names = {source.schema.names[at]: ck for at, ck in m.items()}
        assert set(names) == {"v__ref", "text__ref"}
        for at, ck in m.items():   # every mark is what checking the keys finds
            assert ck == whole_chunk(source.column(at)), (source.num_rows, names)
    assert all(ck is None for ck in by_rows[64][1].values())
    nulls = {by_rows[40][0].schema.names[at]: ck for at, ck in by_rows[40][1].items()}
    assert nulls["text__ref"] is None and nulls["v__ref"] is not None
    assert all(ck is not None for ck in by_rows[24][1].values())
    assert _claim_all(s) == _as_put(*together, with_nulls, alone)
