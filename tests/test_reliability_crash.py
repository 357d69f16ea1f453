"""Crash durability: ``kill -9`` of the server loses no acknowledged write and no ack.

The server runs as a subprocess under producer threads and consumer threads (remote stores over
``grpc://127.0.0.1``); it is killed with SIGKILL at random moments and restarted on the same files
(the loop is ``scripts/crash_loop.py``, which states every check it makes). Default run: 4 crashes;
``-m slow``: 100.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import store
from store.errors import LeaseExpired

import reliability_helpers as rh

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "crash_loop.py"


def _crash_loop():
    spec = importlib.util.spec_from_file_location("crash_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


SEED = int(os.environ.get("EXPSTORE_CRASH_SEED", "1"))


def test_kill_9_under_load_loses_nothing_acknowledged(tmp_path):
    report = _crash_loop().run_crash_loop(tmp_path, crashes=4, seed=SEED)
    assert report["lost"] == report["duplicated"] == 0
    assert report["rows"] >= report["acked_put_rows"] > 0
    assert report["acked_ack_rows"] > 0
    # The consumers left some micro-batches unacked; they came back and were consumed.
    assert report["unacked_redelivered"] + report["unacked_consumed_by_lost_answer"] == \
        report["unacked_claimed_rows"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_9_one_hundred_times(tmp_path):
    report = _crash_loop().run_crash_loop(tmp_path, crashes=100, seed=SEED)
    assert report["lost"] == report["duplicated"] == 0
    assert report["acked_put_rows"] > 0 and report["acked_ack_rows"] > 0
    print(report)


def test_lease_taken_before_a_crash_resumes_and_expires_after_restart(tmp_path):
    """A claim whose lease was written before the crash is restored (the trainer may still ack);
    one whose lease has expired is refused, and its rows are ready again and claimable."""
    srv = rh.ServerProcess(tmp_path / "x.duckdb").start()
    try:
        with store.connect(srv.uri) as s:
            s.create_table("t", {"reward": "float64"}, lease_seconds=60.0)
            ids = rh.sample_ids("q", 0, 20)
            s.put("t", {"sample_id": ids, "reward": [rh.reward_of(i) for i in ids]})
            long = s.claim("t", 5, lease_seconds=60.0)
            short = s.claim("t", 5, lease_seconds=1.0)
            acked = s.claim("t", 5)
            s.ack(acked.claim_id)
            # Make sure the lease bookkeeping of the claims reached DuckDB before the kill: the
            # writer flushes it with the next group commit (the ack above is one).
        srv.kill()
        srv.start()
        with store.connect(srv.uri) as s:
            st = s.stats("t")["t"]
            assert st["consumed"] == 5 and st["rows"] == 20
            assert s.ack(long.claim_id)["acked"] == 5       # the restored lease is honoured
            rh.wait_until(lambda: s.stats("t")["t"]["processing"] == 0, 10,
                          "the short lease expired after the restart")
            with pytest.raises(LeaseExpired):
                s.ack(short.claim_id)
            got = s.claim("t", 20)
            assert sorted(got.data.column("sample_id").to_pylist()) == sorted(
                short.data.column("sample_id").to_pylist()
                + [i for i in ids if i not in long.data.column("sample_id").to_pylist()
                   and i not in acked.data.column("sample_id").to_pylist()
                   and i not in short.data.column("sample_id").to_pylist()])
            redelivered = {sid: d for sid, d in zip(got.data.column("sample_id").to_pylist(),
                                                    got.data.column("delivery_count").to_pylist())}
            assert all(redelivered[sid] == 2 for sid in short.data.column("sample_id").to_pylist())
            s.ack(got.claim_id)
            assert s.stats("t")["t"]["consumed"] == 20
    finally:
        srv.stop()
