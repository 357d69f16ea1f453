"""Resource faults: a full disk, a read-only directory, a damaged blob segment, a newer catalog.

Each fault is real (a tiny tmpfs filled up or remounted read-only, bytes overwritten in a segment
file, the catalog stamp rewritten), never mocked. After each: a put that failed raised (a
:class:`store.errors.StorageError` naming what went wrong), every put that returned is there, and
the store works again once the cause is gone. Mounting needs root; without it those tests skip and
say why (root also ignores ``chmod``, which is why a read-only *mount* is used).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import duckdb
import pytest

import store
from flight_fixtures import running_server
from store.errors import CatalogOutdated, StorageError, StorageUnavailable, StoreClosed

import reliability_helpers as rh


class Tmpfs:
    """A tmpfs of a given size mounted at ``path`` (unmounted at teardown)."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to simulate the fault (needs root or "
                        f"CAP_SYS_ADMIN): {r.stderr.strip()}")

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.path)], check=True)

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 16 * 1024) -> Path:
        """Fill the file system up to ``leave`` bytes; returns the filler to delete."""
        filler = self.path / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, self.free_bytes() - leave))
        return filler

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path) -> Iterator:
    mounted: list[Tmpfs] = []

    def make(name: str, size: str) -> Tmpfs:
        fs = Tmpfs(tmp_path / name, size)
        mounted.append(fs)
        return fs

    yield make
    for fs in reversed(mounted):
        fs.unmount()


def _rows(prefix: str, n: int, big: bool) -> dict:
    ids = rh.sample_ids(prefix, 0, n)
    return {"sample_id": ids, "response": [rh.response_of(i, big) * (40 if big else 1)
                                           for i in ids],
            "reward": [rh.reward_of(i) for i in ids]}


def _put_until_failure(s, prefix: str, big: bool, attempts: int = 400) -> tuple[list[str], str]:
    """Put batches until one fails; return the ids of the puts that returned, and the error."""
    returned: list[str] = []
    for k in range(attempts):
        batch = _rows(f"{prefix}{k}x", 50, big)
        try:
            s.put("t", batch)
        except StorageError as e:
            return returned, str(e)
        returned.extend(batch["sample_id"])
    raise AssertionError(f"no put failed in {attempts} attempts: the fault did not bite")


def _stored(s) -> dict[str, float]:
    t = s.query('SELECT sample_id, reward FROM "t"')
    return dict(zip(t.column("sample_id").to_pylist(), t.column("reward").to_pylist()))


def _check_returned(s, returned: list[str]) -> None:
    stored = _stored(s)
    missing = [i for i in returned if i not in stored]
    assert not missing, f"{len(missing)} puts that returned are gone, e.g. {missing[:5]}"
    assert all(stored[i] == rh.reward_of(i) for i in returned)


def _table(s) -> None:
    s.create_table("t", {"response": "string", "reward": "float64"}, lease_seconds=5.0)


# -- a full disk ------------------------------------------------------------------------------
def test_full_blob_disk_fails_puts_cleanly_and_recovers(tmp_path, tmpfs):
    blobs = tmpfs("blobs", "1m")
    s = store.connect(str(tmp_path / "x.duckdb"), blob_dir=str(blobs.path))
    try:
        _table(s)
        returned, error = _put_until_failure(s, "big", big=True)
        assert "blob segment" in error and "No space left" in error, error
        # By-value rows do not need the blob disk: they still go in.
        small = _rows("small", 20, big=False)
        s.put("t", small)
        returned += small["sample_id"]
        _check_returned(s, returned)
        before = len(_stored(s))
        blobs.remount("size=64m")                      # the cause is gone
        more = _rows("after", 50, big=True)
        s.put("t", more)
        returned += more["sample_id"]
        assert len(_stored(s)) == before + 50
        claim = s.claim("t", 10_000)
        assert claim.num_rows == len(returned)        # the failed puts left no rows behind
        by_id = dict(zip(claim.data.column("sample_id").to_pylist(),
                         claim.data.column("response").to_pylist()))
        assert all(by_id[i].startswith(i) for i in returned)   # blob values read back
        s.ack(claim.claim_id)
    finally:
        s.close()
    with store.connect(str(tmp_path / "x.duckdb"), blob_dir=str(blobs.path)) as s:
        _check_returned(s, returned)
        assert s.stats("t")["t"]["consumed"] == len(returned)


@pytest.mark.parametrize("close_while_full", [False, True])
def test_full_database_disk_fails_puts_cleanly_and_recovers(tmpfs, close_while_full):
    fs = tmpfs("db", "16m")
    path = str(fs.path / "x.duckdb")
    s = store.connect(path)
    try:
        _table(s)
        s.checkpoint()
        filler = fs.fill()
        returned, error = _put_until_failure(s, "v", big=False)
        assert "No space left" in error, error
        # Puts acknowledged from the put log cannot reach DuckDB meanwhile: a read would miss
        # them, so it is refused (retryable), and health says why, until the store recovers.
        with pytest.raises(StorageUnavailable, match="No space left"):
            _stored(s)
        health = s.health()
        assert health["status"] == "failed" and "No space left" in health["error"], health
        assert health["storage"]["waiting_changes"] > 0
        with pytest.raises(StorageUnavailable):
            s.put("t", _rows("refused", 5, big=False))
        if close_while_full:
            # What the put log holds is applied when the store opens again.
            s.close()
            filler.unlink()
            s = store.connect(path)
            _check_returned(s, returned)
        filler.unlink(missing_ok=True)                # the cause is gone
        rh.wait_until(lambda: s.health()["status"] == "ok", 30, "recovery once space is free")
        more = _rows("after", 30, big=False)
        s.put("t", more)
        returned += more["sample_id"]
        _check_returned(s, returned)
        claim = s.claim("t", 100_000)
        assert claim.num_rows == len(returned)
        s.ack(claim.claim_id)
    finally:
        s.close()
    with store.connect(path) as s:
        _check_returned(s, returned)
        assert len(_stored(s)) == len(returned)
        assert s.stats("t")["t"]["consumed"] == len(returned)


def _fill_wal(s, rows: int = 8000) -> list[str]:
    """Put ``rows`` rows of random-looking text (they compress badly: a checkpoint must write
    about their size) and wait until DuckDB's WAL holds them; returns their ids."""
    ids: list[str] = []
    for k in range(rows // 200):
        batch = rh.sample_ids(f"w{k}x", 0, 200)
        s.put("t", {"sample_id": batch, "response": [os.urandom(200).hex() for _ in batch],
                    "reward": [rh.reward_of(i) for i in batch]})
        ids += batch
    assert s.query('SELECT count(*) AS n FROM "t"').column("n")[0].as_py() == len(ids)
    return ids


def test_a_checkpoint_on_a_full_disk_fails_the_store_clearly_and_it_recovers(tmpfs, caplog):
    """The issue's scenario: the disk fills while DuckDB holds a WAL of a few MB; the writer's
    idle checkpoint fails and DuckDB invalidates the database. Health and /metrics say failed
    with the cause; puts, acks and SQL get the retryable StorageUnavailable at once (no put is
    acknowledged into a log that cannot reach DuckDB); the log holds a few lines, not a storm;
    once space is free the store reopens DuckDB by itself, and nothing acknowledged is lost."""
    import logging
    import urllib.request
    from store.errors import Unavailable

    fs = tmpfs("db", "24m")
    path = str(fs.path / "x.duckdb")
    embedded = store.connect(path)
    caplog.set_level(logging.DEBUG, logger="expstore")
    try:
        with running_server(embedded, metrics_port=0) as server, \
                store.connect(server.location) as s:
            _table(s)
            returned = _fill_wal(s)
            claim = s.claim("t", 5, lease_seconds=600.0)
            filler = fs.fill(leave=64 * 1024)
            # The writer checkpoints once idle (seconds): it fails for want of room.
            rh.wait_until(lambda: s.health()["status"] == "failed", 30,
                          "health reporting the failed checkpoint")
            health = s.health()
            assert "No space left" in health["error"], health
            assert health["storage"]["reopen_needed"] is True
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
                scraped = r.read().decode()
            assert 'expstore_health{error="the database cannot be written: ' in scraped
            assert 'status="failed"' in scraped and "No space left" in scraped
            logged_before = len(caplog.records)
            refused = 0
            for k in range(200):  # a producer retrying hard: one line, not one per put
                with pytest.raises(StorageUnavailable, match="No space left.*retry later"):
                    s.put("t", _rows(f"refused{k}x", 5, big=False))
                refused += 1
            with pytest.raises(Unavailable):  # retryable: producers/writer.py retries it
                s.put("t", _rows("refusedagain", 5, big=False))
            with pytest.raises(StorageUnavailable):
                s.ack(claim.claim_id)
            with pytest.raises(StorageUnavailable, match="a read now would miss"):
                s.query('SELECT count(*) FROM "t"')
            noisy = [r for r in caplog.records[logged_before:] if r.levelno >= logging.WARNING]
            assert len(noisy) <= 3, [r.getMessage()[:120] for r in noisy]
            filler.unlink()                           # the cause is gone
            rh.wait_until(lambda: s.health()["status"] == "ok", 30,
                          "the store recovering once space is free")
            assert s.ack(claim.claim_id)["acked"] == 5   # the lease stayed as it was
            more = _rows("after", 30, big=False)
            s.put("t", more)
            returned += more["sample_id"]
            _check_returned(s, returned)
            assert len(_stored(s)) == len(returned)   # no refused put left a row
        recovered = [r.getMessage() for r in caplog.records
                     if "can be written again" in r.getMessage()]
        assert len(recovered) == 1, recovered
    finally:
        embedded.close()
    with store.connect(path) as s:
        _check_returned(s, returned)
        assert len(_stored(s)) == len(returned)
        assert s.stats("t")["t"]["consumed"] == 5


# -- a read-only directory --------------------------------------------------------------------
def test_read_only_blob_directory_fails_puts_cleanly_and_recovers(tmp_path, tmpfs):
    blobs = tmpfs("blobs", "64m")
    s = store.connect(str(tmp_path / "x.duckdb"), blob_dir=str(blobs.path))
    try:
        _table(s)
        first = _rows("first", 10, big=True)
        s.put("t", first)
        blobs.remount("ro")
        with pytest.raises(StorageError, match="Read-only file system"):
            s.put("t", _rows("lost", 10, big=True))
        small = _rows("small", 10, big=False)
        s.put("t", small)                             # by value: unaffected
        # What is stored by reference stays readable from the read-only segments.
        claim = s.claim("t", 100)
        assert claim.num_rows == 20
        s.nack(claim.claim_id)
        blobs.remount("rw")                           # the cause is gone
        again = _rows("again", 10, big=True)
        s.put("t", again)
        returned = first["sample_id"] + small["sample_id"] + again["sample_id"]
        _check_returned(s, returned)
        assert len(_stored(s)) == 30
    finally:
        s.close()


def test_read_only_database_directory(tmpfs):
    """A store cannot be opened on a read-only directory: a clear StorageError, and it opens
    once the directory is writable again. (Remounting read-only *while* DuckDB holds the file open
    is refused by the kernel, "busy"; write failures under an open store are the disk-full
    test's.)"""
    fs = tmpfs("db", "64m")
    path = str(fs.path / "x.duckdb")
    with store.connect(path) as s:
        _table(s)
        first = _rows("first", 10, big=False)
        s.put("t", first)
    fs.remount("ro")
    with pytest.raises(StorageError, match="(?i)read-only"):
        store.connect(path).close()
    fs.remount("rw")                                  # the cause is gone
    with store.connect(path) as s:
        _check_returned(s, first["sample_id"])
        more = _rows("more", 10, big=False)
        s.put("t", more)
        assert len(_stored(s)) == 20


# -- a damaged blob segment --------------------------------------------------------------------
def _two_chunks(tmp_path) -> tuple[str, list[str], list[str], list[str], str]:
    path = str(tmp_path / "x.duckdb")
    with store.connect(path) as s:
        _table(s)
        a, b = _rows("a", 5, big=True), _rows("b", 5, big=True)
        small = _rows("s", 5, big=False)
        s.put("t", a)
        s.put("t", b)
        s.put("t", small)
        keys = s.query('SELECT sample_id, response__ref FROM "t" WHERE sample_id LIKE \'b%\'')
    key = keys.column("response__ref").to_pylist()[0]
    return path, a["sample_id"], b["sample_id"], small["sample_id"], key


def test_corrupt_blob_chunk_names_the_segment_and_spares_other_rows(tmp_path):
    path, a_ids, b_ids, small_ids, b_key = _two_chunks(tmp_path)
    segment, offset, length, _ = (int(x) for x in b_key.split(":"))
    seg_file = Path(f"{path}.blobs") / f"seg-{segment:08d}.arrow"
    with open(seg_file, "r+b") as f:                  # overwrite bytes inside b's chunk
        f.seek(offset + length // 2)
        f.write(b"\xde\xad\xbe\xef" * 16)
    with store.connect(path) as s:
        with pytest.raises(StorageError) as info:
            s.query("SELECT sample_id, response, response__ref FROM t WHERE sample_id LIKE 'b%'")
        assert seg_file.name in str(info.value)
        ok = s.query("SELECT sample_id, response, response__ref FROM t "
                     "WHERE sample_id NOT LIKE 'b%'")
        got = dict(zip(ok.column("sample_id").to_pylist(), ok.column("response").to_pylist()))
        assert sorted(got) == sorted(a_ids + small_ids)
        assert all(got[i].startswith(i) for i in got)
        # A claim that would include a damaged row fails with the same error and leases nothing.
        with pytest.raises(StorageError):
            s.claim("t", 100)
        assert s.stats("t")["t"]["processing"] == 0
        # The healthy rows can still be claimed (by predicate) and consumed.
        claim = s.claim("t", 100, where="sample_id NOT LIKE 'b%'")
        assert sorted(claim.data.column("sample_id").to_pylist()) == sorted(a_ids + small_ids)
        s.ack(claim.claim_id)


def test_a_same_length_text_overwrite_inside_a_value_is_detected(tmp_path):
    path, _, b_ids, _, b_key = _two_chunks(tmp_path)
    segment, offset, length, _ = (int(x) for x in b_key.split(":"))
    seg_file = Path(f"{path}.blobs") / f"seg-{segment:08d}.arrow"
    with open(seg_file, "r+b") as f:
        f.seek(offset + length // 2)
        f.write(b"Z" * 8)
    with store.connect(path) as s:
        with pytest.raises(StorageError):
            rows = s.query("SELECT sample_id, response, response__ref FROM t")
            ok = all(r == rh.response_of(i, True) * 40 for i, r in zip(
                rows.column("sample_id").to_pylist(), rows.column("response").to_pylist()))
            assert ok, "the damaged value was served as if it were intact"


def test_missing_blob_segment_names_it_and_by_value_rows_survive(tmp_path):
    path, a_ids, b_ids, small_ids, b_key = _two_chunks(tmp_path)
    segment = int(b_key.split(":")[0])
    seg_file = Path(f"{path}.blobs") / f"seg-{segment:08d}.arrow"
    moved = seg_file.with_suffix(".moved")
    seg_file.rename(moved)
    with store.connect(path) as s:
        with pytest.raises(StorageError) as info:
            s.query("SELECT sample_id, response, response__ref FROM t")
        assert seg_file.name in str(info.value)
        # Rows whose values are inline are read without the missing segment: the filter on
        # the key runs before any value is resolved.
        small = s.query("SELECT sample_id, response FROM t WHERE response__ref IS NULL")
        assert sorted(small.column("sample_id").to_pylist()) == sorted(small_ids)
        assert all(r.startswith(i) for i, r in zip(small.column("sample_id").to_pylist(),
                                                   small.column("response").to_pylist()))
        # SQL over by-value columns keeps working for every row.
        n = s.query("SELECT count(*) AS n, sum(reward) AS r FROM t").to_pylist()[0]
        assert n["n"] == 15
    moved.rename(seg_file)                            # the cause is gone
    with store.connect(path) as s:
        rows = s.query("SELECT sample_id, response, response__ref FROM t")
        assert all(r.startswith(i) for i, r in zip(rows.column("sample_id").to_pylist(),
                                                   rows.column("response").to_pylist()))


# -- a catalog from a newer expstore ----------------------------------------------------------
def test_database_from_a_newer_catalog_version_is_refused(tmp_path):
    path = str(tmp_path / "x.duckdb")
    with store.connect(path) as s:
        _table(s)
        s.put("t", _rows("q", 3, big=False))
    con = duckdb.connect(path)
    (revision,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
    con.execute("UPDATE alembic_version SET version_num = 'ffff_from_the_future'")
    con.close()
    with pytest.raises(CatalogOutdated) as info:
        store.connect(path)
    assert "ffff_from_the_future" in str(info.value) and "newer" in str(info.value)
    con = duckdb.connect(path)                        # the cause is gone
    con.execute("UPDATE alembic_version SET version_num = ?", [revision])
    con.close()
    with store.connect(path) as s:
        assert len(_stored(s)) == 3


# -- a bug in the writer -----------------------------------------------------------------------
def test_a_writer_stopped_by_a_bug_fails_writes_instead_of_leaving_them_waiting(
        open_store, db_path, monkeypatch):
    s = open_store()
    s.create_table("t", {"x": "float64"})
    s.put("t", {"sample_id": ["kept_0_0"], "x": [1.0]})
    rh.inject_writer_bug(monkeypatch, s)
    waiting = s.put_async("t", {"sample_id": ["lost_0_0"], "x": [2.0]})
    with pytest.raises(StoreClosed, match="injected writer bug"):
        waiting.result(30)  # failed, not left waiting for ever
    with pytest.raises(StoreClosed, match="injected writer bug.*open the store again"):
        s.put("t", {"sample_id": ["later_0_0"], "x": [3.0]})  # refused at once
    health = s.health()
    assert health["status"] == "failed" and "injected writer bug" in health["error"]
    s.close()
    again = open_store()
    assert again.health()["status"] == "ok"
    assert again.query("SELECT sample_id FROM t").column("sample_id").to_pylist() == ["kept_0_0"]


def test_a_server_whose_writer_stopped_answers_store_closed_and_reports_failed(
        tmp_path, monkeypatch):
    embedded = store.connect(str(tmp_path / "x.duckdb"))
    try:
        with running_server(embedded) as server:
            with store.connect(server.location) as s:
                s.create_table("t", {"x": "float64"})
                rh.inject_writer_bug(monkeypatch, embedded)
                with pytest.raises(StoreClosed, match="injected writer bug"):
                    s.put("t", {"sample_id": ["a_0_0"], "x": [1.0]})
                health = s.health()
                assert health["status"] == "failed" and "injected writer bug" in health["error"]
    finally:
        embedded.close()
