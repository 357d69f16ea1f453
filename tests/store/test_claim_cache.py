"""The claim cache (store/cache.py): ready rows' values kept in memory up to a limit; rows put
past it are claimed from DuckDB with the same values; the bytes counted come back as rows are
consumed; rows of the put log stay cached until DuckDB has them.
"""
from __future__ import annotations

import pytest

from store.settings import StoreSettings
import store
from flight_fixtures import running_server
from store import writer
from store.cache import ClaimCache, parse_size
from store.errors import InvalidArgument

COLUMNS = {"response": "string", "reward": "float64", "token_ids": "list<int32>",
           "note": "string"}
BULK = StoreSettings().log_put_rows + 100  # over the put log's bound: a DuckDB transaction


def _rows(prefix: str, n: int) -> dict:
    return {"sample_id": [f"{prefix}{i}_0_{i % 4}" for i in range(n)],
            "response": [f"answer {i} " * (1 + i % 5) for i in range(n)],
            "reward": [i / 7 for i in range(n)],
            "token_ids": [list(range(i % 9)) for i in range(n)],
            "note": [f"by reference {i}" for i in range(n)]}


def _table(s) -> None:
    s.create_table("t", COLUMNS, storage={"note": "ref"}, lease_seconds=60)


def _by_id(data: dict) -> dict[str, tuple]:
    cols = ["response", "reward", "token_ids", "note"]
    return {sid: tuple(data[c][i] for c in cols) for i, sid in enumerate(data["sample_id"])}


def _claim_all(s, limit: int = 1000) -> dict[str, tuple]:
    """Every row's values by sample id, claimed and acked; checks that claims come in order."""
    got: dict[str, tuple] = {}
    order: list[str] = []
    while claim := s.claim("t", limit):
        data = claim.data.to_pydict()
        got.update(_by_id(data))
        order += data["sample_id"]
        s.ack(claim.claim_id)
    assert order == sorted(order, key=_claim_order)
    return got


def _claim_order(sample_id: str) -> tuple[str, int, int]:
    input_id, turn, trajectory = sample_id.rsplit("_", 2)
    return (input_id, int(turn), int(trajectory))



def test_rows_put_while_the_cache_is_full_are_claimed_from_duckdb(open_store):
    s = open_store(cache_limit=0)
    _table(s)
    data = _rows("q", BULK)
    s.put("t", data)
    assert s.cache.used == 0  # nothing of it cached
    assert _claim_all(s) == _by_id(data)
    assert s.cache.used == 0  # rows read back for the claims are counted until consumed


def test_a_cache_under_its_limit_counts_its_bytes_and_gives_them_back(open_store):
    s = open_store()
    _table(s)
    s.put("t", _rows("q", BULK))
    held = s.cache.used
    assert held > 0 and s.health()["claim_cache_bytes"] == held
    claim = s.claim("t", BULK)
    s.ack(claim.claim_id)
    assert s.cache.used == 0


def test_puts_past_the_limit_are_not_cached_and_the_cache_fills_again(open_store):
    s = open_store(cache_limit=1)  # room for one put: it counts, the next does not fit
    _table(s)
    first, second = _rows("a", BULK), _rows("b", BULK)
    s.put("t", first)
    used = s.cache.used
    assert used > 1
    s.put("t", second)
    assert s.cache.used == used
    # A nack makes claimed rows ready again with the values the claim read from DuckDB.
    claim = s.claim("t", 2 * BULK)
    assert claim.data.num_rows == 2 * BULK
    s.nack(claim.claim_id)
    assert _claim_all(s) == {**_by_id(first), **_by_id(second)}
    assert s.cache.used == 0
    third = _rows("c", BULK)
    s.put("t", third)
    assert s.cache.used > 0  # room again
    assert _claim_all(s) == _by_id(third)


def test_partial_writes_completed_past_the_limit_are_claimed_from_duckdb(open_store):
    s = open_store(cache_limit=0)
    _table(s)
    data = _rows("q", 8)
    s.put("t", {k: v for k, v in data.items() if k in ("sample_id", "response", "note")})
    s.put("t", {k: v for k, v in data.items() if k in ("sample_id", "reward", "token_ids")})
    assert _claim_all(s) == _by_id(data)


def test_put_log_rows_stay_cached_until_duckdb_has_them(slow_inserts):
    s = slow_inserts(cache_limit=0)
    _table(s)
    data = _rows("q", 16)
    s.put("t", data)
    assert s._writer.logged_rows == 16
    assert s.cache.used > 0  # DuckDB cannot serve them yet, whatever the limit
    s._writer.materialize()
    assert s._writer.logged_rows == 0
    assert s.cache.used == 0  # in DuckDB now: they left the full cache
    assert _claim_all(s) == _by_id(data)


def test_put_log_rows_under_the_limit_stay_cached_after_duckdb_has_them(slow_inserts):
    s = slow_inserts()
    _table(s)
    s.put("t", _rows("q", 16))
    used = s.cache.used
    s._writer.materialize()
    assert s.cache.used == used > 0


def test_rows_leased_while_the_cache_evicts_come_back_with_their_values(slow_inserts):
    s = slow_inserts(cache_limit=0)
    _table(s)
    data = _rows("q", 16)
    s.put("t", data)
    claim = s.claim("t", 4)  # leased before the log reaches DuckDB
    s._writer.materialize()
    s.nack(claim.claim_id)
    assert _claim_all(s) == _by_id(data)


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("512", 512), ("1KB", 1000), ("1kib", 1024), ("1.5GB", 1_500_000_000),
    (" 2 MiB ", 2 << 20), ("1GiB", 1 << 30), (7, 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "1XB", "", "1 G B", -3, True])
def test_parse_size_refuses_what_is_not_a_size(bad):
    with pytest.raises(InvalidArgument, match=repr(bad).replace("(", r"\(")):
        parse_size(bad)


def test_a_bad_cache_limit_is_refused_before_the_store_opens(db_path):
    with pytest.raises(InvalidArgument, match="'plenty'.*expected a number of bytes"):
        store.connect(db_path, cache_limit="plenty")


def test_the_server_takes_a_cache_limit_and_reports_it(tmp_path):
    with running_server(tmp_path / "x.duckdb", cache_limit=0) as server:
        with store.connect(server.location) as s:
            _table(s)
            data = _rows("q", BULK)
            s.put("t", data)
            health = s.health()
            assert health["claim_cache_limit"] == 0 and health["claim_cache_bytes"] == 0
            assert _claim_all(s) == _by_id(data)


def test_the_count_goes_back_when_a_table_is_freed():
    import pyarrow as pa
    cache = ClaimCache(limit=10)
    table = pa.table({"x": list(range(100))})
    assert cache.admit(table) and cache.used == table.get_total_buffer_size() and cache.full
    assert not cache.admit(pa.table({"x": [1]}))
    del table
    assert cache.used == 0


def test_a_claim_reading_duckdb_reads_the_next_rows_too(open_store, monkeypatch):
    s = open_store(cache_limit=0)
    _table(s)
    data = _rows("q", BULK)
    s.put("t", data)
    reads: list[int] = []
    real = s._claims.load_payloads

    def counted(live, row_ids):
        reads.append(len(row_ids))
        return real(live, row_ids)

    monkeypatch.setattr(s._claims, "load_payloads", counted)
    assert _claim_all(s, 16) == _by_id(data)
    # 265 claims of 16; the first reads 1,024 rows, then as many as 16 MiB of these rows hold
    # (over 4,096); so a handful of reads, not one per claim.
    assert reads[0] == 1024 + 16 and len(reads) <= 3 and sum(reads) == BULK


def test_a_write_during_a_read_ahead_keeps_its_values(open_store, monkeypatch):
    s = open_store(cache_limit=0)
    _table(s)
    data = _rows("q", BULK)
    s.put("t", data)
    real = s._claims.load_payloads
    first = sorted(data["sample_id"], key=_claim_order)
    ahead = first[100]  # read ahead by the first claim, rewritten while that read runs

    def write_while_reading(live, row_ids):
        loaded = real(live, row_ids)  # the values before the write
        if s._claims.load_payloads is write_while_reading:
            monkeypatch.setattr(s._claims, "load_payloads", real)
            s.put("t", {"sample_id": [ahead], "response": ["rewritten"]})
        return loaded

    monkeypatch.setattr(s._claims, "load_payloads", write_while_reading)
    got = _claim_all(s, 16)
    assert got[ahead][0] == "rewritten"
    assert {k: v for k, v in got.items() if k != ahead} == \
        {k: v for k, v in _by_id(data).items() if k != ahead}


def test_puts_held_inline_and_by_reference_each_claim_their_own_values(open_store):
    """How a cached put's columns divide (all of a by-reference column inline, or keys) is
    kept per put: puts of both kinds, one after another, each freed once its rows are
    consumed (so a later put's cached table may take its place in memory), claim their own
    values."""
    s = open_store()
    _table(s)
    for round_ in range(12):
        long = round_ % 2 == 1
        data = _rows(f"r{round_}x", 40)
        data["note"] = [("long " * 200 if long else "short ") + f"{round_}.{i}"
                        for i in range(40)]
        s.put("t", data)
        assert _claim_all(s, limit=16) == _by_id(data)


@pytest.mark.parametrize("options", [{}, {"blob_recent_bytes": 0}, {"blob_recent_bytes": 400_000},
                                     {"cache_limit": 1}],
                         ids=["chunks-held", "chunks-on-disk", "first-put-partly-on-disk",
                              "second-put-from-duckdb"])
def test_claims_spanning_puts_carry_each_rows_values_and_deliveries(open_store, options):
    """Claims whose rows come from two puts, their groups interleaved in claim order (sliced
    by runs from both puts' held columns, or each put's rows cut first where its values are not
    held): every row comes with its own values,
    by value and by reference, and its own delivery count, in claim order; whether the puts'
    blob chunks are held in memory or read from disk, or one put's are held and the other's
    not (each put's chunks take ~290 KB: 400 KB holds the second's and part of the first's),
    and whether a put's rows are cached or read back from DuckDB."""
    s = open_store(**options)
    s.create_table("t", COLUMNS, storage={"note": "ref", "response": "ref"}, lease_seconds=60)
    both = _rows("q", 2 * BULK)
    puts = [{c: v[parity::2] for c, v in both.items()} for parity in (0, 1)]
    for data in puts:
        s.put("t", data)
    first = s.claim("t", 7)
    assert len({sid[1:].split("_")[0] for sid in first.data["sample_id"].to_pylist()}) == 7
    s.nack(first.claim_id)                     # these come again, delivered twice
    again = set(first.data["sample_id"].to_pylist())
    got: dict[str, tuple] = {}
    order: list[str] = []
    spanning = 0
    while claim := s.claim("t", 64):
        data = claim.data.to_pydict()
        assert data["delivery_count"] == [2 if sid in again else 1
                                          for sid in data["sample_id"]]
        spanning += len({int(sid[1:].split("_")[0]) % 2 for sid in data["sample_id"]}) > 1
        got.update(_by_id(data))
        order += data["sample_id"]
        s.ack(claim.claim_id)
    assert order == sorted(order, key=_claim_order)
    assert got == _by_id(both)
    assert spanning > 2 * BULK // 64 // 2
