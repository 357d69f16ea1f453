"""Metrics: after a scripted run of puts, claims, acks, nacks, an expiry and dead letters, the
Prometheus endpoint's counters and per-table queue-depth gauges say exactly what happened."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

import store
from store.errors import StoreClosed
from flight_server.server import ExpstoreFlightServer

import reliability_helpers as rh
from flight_fixtures import TOKENS, WRONG_TOKEN, write_tokens


@pytest.fixture
def server(tmp_path) -> Iterator[ExpstoreFlightServer]:
    srv = ExpstoreFlightServer(str(tmp_path / "x.duckdb"), host="127.0.0.1", port=0,
                               metrics_port=0)
    thread = threading.Thread(target=srv.serve, name="metrics-test-server", daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.close()
        thread.join(timeout=30)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def counter(m: dict, name: str) -> float:
    return m[(f"expstore_{name}_total", ())]


def gauge(m: dict, name: str, table: str) -> float:
    return m[(f"expstore_{name}", (("table", table),))]


def test_counters_and_queue_depths_match_what_happened(server):
    assert server.metrics_port
    with store.connect(server.location) as s:
        s.create_table("m", {"response": "string", "reward": "float64"}, max_deliveries=2,
                       lease_seconds=60.0)
        s.create_table("n", {"reward": "float64"})
        ids = rh.sample_ids("q", 0, 10)
        s.put("m", {"sample_id": ids[:6], "response": ["r"] * 6, "reward": [1.0] * 6})
        s.put("m", {"sample_id": ids[6:], "response": ["r"] * 4, "reward": [1.0] * 4})
        s.put("m", {"sample_id": ["p0_0_0", "p1_0_0"], "reward": [0.5, 0.5]})  # pending
        s.put("n", {"sample_id": rh.sample_ids("z", 0, 5), "reward": [2.0] * 5})

        acked = s.claim("m", 4)                                   # q0..q3
        s.ack(acked.claim_id)
        nacked = s.claim("m", 3)                                  # q4..q6
        s.nack(nacked.claim_id)
        expiring = s.claim("m", 3, lease_seconds=0.3)             # q4..q6 again
        assert expiring.data.column("sample_id").to_pylist() == \
            nacked.data.column("sample_id").to_pylist()
        # Their second delivery reaches max_deliveries=2: the expiry dead-letters them.
        rh.wait_until(lambda: counter(scrape(server.metrics_port), "leases_expired") == 1, 10,
                      "the short lease expired")
        held = s.claim("m", 1)                                    # q7, leased
        s.bump_version("n")
        n_claim = s.claim("n", 2)            # nothing: an empty claim leases and counts nothing

        m = scrape(server.metrics_port)
        expected = {"puts": 4, "rows_put": 17, "claims": 4, "rows_claimed": 11, "acks": 1,
                    "rows_acked": 4, "nacks": 1, "leases_expired": 1, "redeliveries": 3,
                    "dead_letters": 3, "version_bumps": 1, "stale_rows": 5}
        got = {k: counter(m, k) for k in expected}
        assert got == expected
        # Queue depths per table.
        assert gauge(m, "ready_rows", "m") == 2                   # q8, q9
        assert gauge(m, "processing_rows", "m") == 1              # q7
        assert gauge(m, "pending_rows", "m") == 2                 # p0, p1
        assert gauge(m, "version", "m") == 0
        # Table "n": version 1 after the bump; its rows were at version 0 and max_staleness is
        # 0, so they became stale and nothing is ready.
        assert gauge(m, "version", "n") == 1
        assert gauge(m, "ready_rows", "n") == gauge(m, "processing_rows", "n") == 0
        assert n_claim.num_rows == 0
        # They agree with the store's own view.
        st = s.stats()
        assert (st["m"]["ready"], st["m"]["processing"], st["m"]["pending"],
                st["m"]["consumed"], st["m"]["dead"]) == (2, 1, 2, 4, 3)
        assert m[("expstore_writer_queue_depth", ())] >= 0
        # Latency histograms count every request by verb (small puts go on the session: "put").
        assert m[("expstore_request_seconds_count", (("verb", "put"),))] == 4
        assert m[("expstore_request_seconds_count", (("verb", "ack"),))] == 1
        assert m[("expstore_request_seconds_count", (("verb", "nack"),))] == 1
        s.ack(held.claim_id)
        m = scrape(server.metrics_port)
        assert counter(m, "acks") == 2 and gauge(m, "processing_rows", "m") == 0


def test_stale_rows_count_rows_staled_by_a_bump_and_by_a_settle_once_each(server):
    """Issue 29: rows a version bump made stale were not counted, only leased rows staled when
    their lease ended."""
    with store.connect(server.location) as s:
        s.create_table("v", {"reward": "float64"})
        s.put("v", {"sample_id": rh.sample_ids("s", 0, 3), "reward": [1.0] * 3})
        held = s.claim("v", 1)
        s.bump_version("v")                                    # 2 free rows stale at once
        assert counter(scrape(server.metrics_port), "stale_rows") == 2
        s.nack(held.claim_id)                                  # the leased one, when settled
        m = scrape(server.metrics_port)
        assert counter(m, "stale_rows") == 3
        assert s.stats("v")["v"]["stale"] == 3


def test_metrics_move_under_load(server):
    """Counters are monotonic and the queue depth follows producers and a consumer."""
    with store.connect(server.location) as s:
        s.create_table("w", {"reward": "float64"})
        depths = []
        for k in range(5):
            s.put("w", {"sample_id": rh.sample_ids(f"b{k}x", 0, 20), "reward": [1.0] * 20})
            depths.append(gauge(scrape(server.metrics_port), "ready_rows", "w"))
        assert depths == [20, 40, 60, 80, 100]
        seen = []
        for _ in range(5):
            c = s.claim("w", 20)
            s.ack(c.claim_id)
            m = scrape(server.metrics_port)
            seen.append((gauge(m, "ready_rows", "w"), counter(m, "rows_acked")))
        assert seen == [(80, 20), (60, 40), (40, 60), (20, 80), (0, 100)]
        t0 = time.monotonic()
        scrape(server.metrics_port)
        assert time.monotonic() - t0 < 2.0


def test_writer_up_drops_to_zero_when_the_writer_stops(server, monkeypatch):
    with store.connect(server.location) as s:
        s.create_table("u", {"reward": "float64"})
        assert scrape(server.metrics_port)[("expstore_writer_up", ())] == 1
        rh.inject_writer_bug(monkeypatch, server.store)
        with pytest.raises(StoreClosed, match="injected writer bug"):
            s.put("u", {"sample_id": ["a_0_0"], "reward": [1.0]})
        assert scrape(server.metrics_port)[("expstore_writer_up", ())] == 0


def _status_of(port: int, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_need_a_token_when_the_server_has_tokens(tmp_path):
    """Issue 29: /metrics answered anyone while every Flight call needed a token."""
    tokens = write_tokens(tmp_path / "tokens.json")
    srv = ExpstoreFlightServer(str(tmp_path / "x.duckdb"), host="127.0.0.1", port=0,
                               metrics_port=0, metrics_host="127.0.0.1", tokens_file=tokens)
    thread = threading.Thread(target=srv.serve, name="metrics-auth-server", daemon=True)
    thread.start()
    try:
        assert srv.metrics_host == "127.0.0.1"
        status, body = _status_of(srv.metrics_port, None)
        assert status == 401 and "bearer token" in body and "expstore_" not in body
        status, body = _status_of(srv.metrics_port, WRONG_TOKEN)
        assert status == 401 and "not valid" in body and "expstore_" not in body
        status, body = _status_of(srv.metrics_port, TOKENS["reader"])  # any role may scrape
        assert status == 200 and "expstore_rows_put_total" in body
    finally:
        srv.close()
        thread.join(timeout=30)


def test_serve_help_documents_how_metrics_are_protected():
    from click.testing import CliRunner
    from expstore.cli import cli

    text = " ".join(CliRunner().invoke(cli, ["serve", "--help"]).output.split())
    assert "--metrics-host" in text and "Bearer" in text and "401" in text


def _on_disk(db: str) -> dict[str, int]:
    import os
    blobs = f"{db}.blobs"
    size = lambda p: os.path.getsize(p) if os.path.exists(p) else 0  # noqa: E731
    return {"database": size(db), "wal": size(f"{db}.wal"), "putlog": size(f"{db}.putlog"),
            "blobs": sum(os.path.getsize(os.path.join(blobs, f)) for f in os.listdir(blobs))}


def test_disk_gauges_follow_the_files_through_puts_and_a_gc(server, tmp_path, wait_until):
    """An operator alerts on a store's disk from /metrics: ``expstore_disk_bytes{file=…}`` is
    what the database, its WAL, the put log and the blob segments hold, before and after a
    ``gc --drop`` frees segments (compared once the writer is idle: a checkpoint or the put
    log's apply may change the files between a scrape and a look at the disk)."""
    db = str(tmp_path / "x.duckdb")
    s = store.connect(server.location)
    s.create_table("t", {"text": "string"}, storage={"text": "ref"})

    def gauges() -> dict[str, int]:
        found = scrape(server.metrics_port)
        return {dict(labels)["file"]: int(value) for (name, labels), value in found.items()
                if name == "expstore_disk_bytes"}

    for i in range(3):
        s.put("t", {"sample_id": [f"q{i}_0_{j}" for j in range(4)], "text": ["x" * 50_000] * 4})
        s.ack(s.claim("t", 4).claim_id)
        s.gc()                                  # a segment per put
    s.bump_version("t")
    wait_until(lambda: gauges() == _on_disk(db), message="the gauges say what is on disk")
    before = gauges()
    assert set(before) == {"database", "wal", "putlog", "blobs"}
    assert before["blobs"] >= 12 * 50_000
    s.gc(drop_rows=["consumed"])
    wait_until(lambda: gauges() == _on_disk(db), message="the gauges follow the gc")
    assert gauges()["blobs"] < before["blobs"] - 8 * 50_000
    s.close()
