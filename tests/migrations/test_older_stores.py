"""A store written by an older expstore (tests/fixtures/make_store_e5fb6a5.py: commit e5fb6a5,
killed with its last puts and ack only in the put log) opens with this one: every row, value
(by-reference ones included), state and version as that version read them back; its leases
void (a restart voids every lease, docs/reliability.md), served over Flight and used as usual."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

import store
from fixtures.make_store_e5fb6a5 import NAME, digest
from flight_fixtures import running_server

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture
def older_store(tmp_path) -> str:
    with tarfile.open(FIXTURES / f"{NAME}.tar.gz") as tar:
        if hasattr(tarfile, "data_filter"):   # Python 3.10.12+, 3.11.4+
            tar.extractall(tmp_path, filter="data")
        else:
            tar.extractall(tmp_path)
    return str(tmp_path / "x.duckdb")


def test_a_store_an_older_version_wrote_reads_back_as_it_did(older_store):
    expected = json.loads((FIXTURES / f"{NAME}.json").read_text())
    with store.connect(older_store) as s:
        assert digest(s) == expected
        stats = {t: s.stats(t)[t] for t in s.list_tables()}
    assert {t: (v["consumed"], v["stale"], v["dead"], v["ready"], v["processing"])
            for t, v in stats.items()} == {
        "solver": (14, 89, 6, 4, 0),    # the two rows leased at the kill are ready again
        "planner": (3, 0, 0, 3, 0),
        "verifier": (2, 0, 0, 7, 0)}    # its put and ack were only in the put log


def test_it_is_served_and_trained_on_as_a_store_of_this_version(older_store):
    with running_server(older_store) as server, store.connect(server.location) as s:
        assert sorted(s.list_tables()) == ["planner", "solver", "verifier"]
        claimed = []
        while (claim := s.claim("solver", 3)).claim_id:
            claimed += claim.data.select(["sample_id", "response", "big"]).to_pylist()
            s.ack(claim.claim_id)
        assert sorted(r["sample_id"] for r in claimed) == [f"v1q{i}_0_0" for i in range(4, 8)]
        assert all(r["response"] == "r" * 3000 and r["big"] == "y" * 70000 for r in claimed)
        assert s.bump_version("planner") == 1 and s.get_version("verifier") == 1
        s.put("solver", [{"sample_id": "new_0_0", "prompt": "p", "response": "n" * 5000,
                          "reward": 0.0, "token_ids": [], "big": "b"}])
        assert s.query("SELECT response FROM solver WHERE sample_id = 'q0_0_0' "
                       "AND policy_version = 0").column(0).to_pylist() == ["resp 0 0 0" * 5]
        # Below the windows: solver's version 0 (10 consumed, 89 stale, 6 dead); the team's
        # version 0 (all but each table's newest row, planner's 6 and verifier's 9).
        assert s.gc(drop_rows=["consumed", "stale", "dead"])["rows_dropped"] == 105 + 5 + 8
    with store.connect(older_store) as s:
        assert s.stats("solver")["solver"]["rows"] == 8 + 1     # version 2's rows, new_0_0
