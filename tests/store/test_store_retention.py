"""Retention: ``gc(drop_rows=...)`` deletes finished rows that no write can reach any more, so
that a store running for days keeps its disk bounded.

Without it a consumed row (and its by-reference values) stays for ever, and ``gc`` alone frees
nothing while every row of a segment is consumed rather than dropped.
"""
from __future__ import annotations

import os

import pytest

import store
from store.errors import InvalidArgument, StaleVersion

TEXT = "v" * 3000


def _blob_bytes(db_path: str) -> int:
    d = f"{db_path}.blobs"
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def _count(s, where: str) -> int:
    return s.query(f"SELECT count(*) FROM t WHERE {where}").column(0)[0].as_py()


def _put_one_by_one(s, ids: list[str]) -> None:
    for sid in ids:  # one put each: with small segments, each lands in a segment of its own
        s.put("t", {"sample_id": [sid], "text": [f"{sid}:{TEXT}"], "reward": [1.0]})


def test_gc_drops_finished_rows_outside_the_staleness_window_and_frees_their_segments(
        open_store, db_path):
    s = open_store(blob_segment_bytes=1024)
    s.create_table("t", {"text": "string", "reward": "float64"}, storage={"text": "ref"},
                   max_staleness=1)
    _put_one_by_one(s, [f"a{i}_0_0" for i in range(10)])
    acked = s.claim("t", 6)
    s.ack(acked.claim_id)
    held = s.claim("t", 2, lease_seconds=600)       # leased through the gc below
    # Version 1: version-0 rows may still be written (max_staleness 1), so none is dropped.
    s.bump_version("t")
    assert s.gc(drop_rows=["consumed"])["rows_dropped"] == 0
    assert _count(s, "consumed") == 6
    # Version 2: version 0 is out of reach; its two free rows become stale.
    s.bump_version("t")
    _put_one_by_one(s, ["b0_0_0", "b1_0_0"])
    s.ack(s.claim("t", 1).claim_id)                 # consumed at version 2: within the window
    before = _blob_bytes(db_path)

    result = s.gc(drop_rows=["consumed"])

    assert result["rows_dropped"] == 6
    assert result["segments_removed"] == 6 and result["bytes_freed"] >= 6 * len(TEXT)
    assert _blob_bytes(db_path) == before - result["bytes_freed"]
    assert _count(s, "policy_version = 0 AND consumed") == 0
    assert _count(s, "policy_version = 2 AND consumed") == 1
    assert _count(s, "stale") == 2                  # not asked for
    stats = s.stats("t")["t"]
    assert (stats["consumed"], stats["stale"], stats["processing"], stats["ready"]) == (1, 2, 2, 1)
    # Every value still referenced reads back: the leased rows', the stale ones', the new ones'.
    texts = s.query("SELECT sample_id, text FROM t").to_pylist()
    assert len(texts) == 6 and all(r["text"] == f"{r['sample_id']}:{TEXT}" for r in texts)
    assert s.ack(held.claim_id)["acked"] == 2
    # A dropped sample cannot come back: its version is refused, so nothing trains twice.
    with pytest.raises(StaleVersion):
        s.put("t", {"sample_id": ["a0_0_0"], "policy_version": [0], "text": ["again"]})

    result = s.gc(drop_rows=["consumed", "stale"])
    assert result["rows_dropped"] == 4              # the 2 acked just now (version 0), 2 stale
    assert _count(s, "policy_version = 0") == 0
    last = s.query("SELECT max(row_id) FROM t").column(0)[0].as_py()
    s.close()

    s = open_store()
    assert _count(s, "true") == 2                   # b0 (consumed at version 2) and b1
    s.put("t", {"sample_id": ["c0_0_0"], "text": ["new"], "reward": [0.0]})
    # Row ids keep growing after a reopen: the table's newest row is never dropped.
    assert s.query("SELECT row_id FROM t WHERE sample_id = 'c0_0_0'").column(0)[0].as_py() > last
    assert sorted(s.query("SELECT text FROM t WHERE sample_id LIKE 'b%'").column(0).to_pylist()
                  ) == [f"b0_0_0:{TEXT}", f"b1_0_0:{TEXT}"]


def test_gc_without_drop_rows_keeps_every_row(open_store):
    s = open_store()
    s.create_table("t", {"text": "string", "reward": "float64"}, storage={"text": "ref"})
    _put_one_by_one(s, ["a0_0_0", "a1_0_0"])
    s.ack(s.claim("t", 2).claim_id)
    s.bump_version("t")
    assert s.gc()["rows_dropped"] == 0
    assert _count(s, "consumed") == 2


def test_dead_rows_are_dropped_only_when_asked(open_store):
    s = open_store()
    s.create_table("t", {"text": "string", "reward": "float64"}, max_deliveries=1)
    _put_one_by_one(s, ["a0_0_0", "a1_0_0"])
    s.nack(s.claim("t", 2).claim_id)                # past max_deliveries: dead-lettered
    s.bump_version("t")
    assert s.gc(drop_rows=["consumed", "stale"])["rows_dropped"] == 0
    assert _count(s, "dead") == 2
    assert s.gc(drop_rows=["dead"])["rows_dropped"] == 1   # the table's newest row stays
    assert _count(s, "dead") == 1


@pytest.mark.parametrize("bad, named", [
    (["ready"], "'ready'"), (["consumed", "processing"], "'processing'"), ("consumed", "list"),
    ([1], "1"), ({"consumed": True}, "list"),
])
def test_gc_refuses_what_it_cannot_drop(any_store, bad, named):
    any_store.create_table("t", {"reward": "float64"})
    with pytest.raises(InvalidArgument) as err:
        any_store.gc(drop_rows=bad)
    assert named in str(err.value) and "consumed, stale, dead" in str(err.value)


def test_disk_stays_bounded_in_a_put_claim_ack_loop(open_store, db_path):
    """A few hundred cycles of put → claim → ack with a version bump every 10 and a
    ``gc(drop_rows=["consumed"])`` every 50: the blob store and the table stay the size of the
    window, where without the drop they grow with every cycle."""
    s = open_store(blob_segment_bytes=64 << 10)
    s.create_table("t", {"text": "string", "reward": "float64"}, storage={"text": "ref"})
    per_cycle = 4 * len(TEXT)
    sizes = []
    for cycle in range(1, 301):
        s.put("t", {"sample_id": [f"c{cycle}_0_{j}" for j in range(4)], "text": [TEXT] * 4,
                    "reward": [1.0] * 4})
        claim = s.claim("t", 4)
        assert claim.data.num_rows == 4
        s.ack(claim.claim_id)
        if cycle % 10 == 0:
            s.bump_version("t")
        if cycle % 50 == 0:
            s.gc(drop_rows=["consumed"])
            sizes.append((_blob_bytes(db_path), _count(s, "true")))
    written = 300 * per_cycle
    assert all(blob < 50 * per_cycle + 2 * (64 << 10) for blob, _ in sizes), (sizes, written)
    assert all(rows <= 10 * 4 for _, rows in sizes), sizes
    assert s.stats("t")["t"]["ready"] == 0


def test_keep_versions_leaves_the_newest_versions_for_sql(any_store):
    """Researchers query recent training data: ``keep_versions=N`` keeps the finished rows of
    the newest N versions (beyond what the staleness window keeps anyway)."""
    s = any_store
    s.create_table("t", {"text": "string", "reward": "float64"}, storage={"text": "ref"})
    for v in range(6):                              # versions 0 … 5, two rows each
        _put_one_by_one(s, [f"v{v}a_0_0", f"v{v}b_0_0"])
        s.ack(s.claim("t", 2).claim_id)
        s.bump_version("t")
    _put_one_by_one(s, ["last_0_0"])                # version 6, ready
    assert s.gc(drop_rows=["consumed"], keep_versions=3)["rows_dropped"] == 6
    assert s.query("SELECT DISTINCT policy_version AS v FROM t ORDER BY v").column("v") \
        .to_pylist() == [3, 4, 5, 6]
    assert s.gc(drop_rows=["consumed"])["rows_dropped"] == 6
    with pytest.raises(InvalidArgument, match="keep_versions -1"):
        s.gc(drop_rows=["consumed"], keep_versions=-1)
    with pytest.raises(InvalidArgument, match="keep_versions 'x'"):
        s.gc(drop_rows=["consumed"], keep_versions="x")
