"""kill -9 durability of the embedded store: no acknowledged write and no ack is lost.

A child process (started with ``subprocess``, not forked) writes samples and acks claims, and
prints each id only after the call returned. The parent SIGKILLs it at some point, reopens the
store and checks that everything printed is there. Several kills hit the same database, so the
store also reopens cleanly after each crash.
"""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import sys
    import store

    path, run = sys.argv[1], int(sys.argv[2])
    s = store.connect(path)
    s.create_table("t", {"response": "string", "ids": "list<int32>", "reward": "float64"},
                   if_not_exists=True)
    print("READY", flush=True)
    i = 0
    while True:
        sids = [f"r{run}q{i + k}_0_0" for k in range(3)]
        s.put("t", {"sample_id": sids,
                    "response": [("x" * 700 if (i + k) % 2 else "") + str(i + k) for k in range(3)],
                    "ids": [list(range((i + k) % 300)) for k in range(3)],
                    "reward": [float(i + k) for k in range(3)]})
        print("W " + ",".join(sids), flush=True)
        i += 3
        if i % 2 == 0:
            claim = s.claim("t", 4)
            if claim:
                ids = claim.data.column("sample_id").to_pylist()
                s.ack(claim.claim_id)
                print("A " + ",".join(ids), flush=True)
""")


def _expected(sid: str) -> tuple[str, list[int], float]:
    n = int(sid.split("q", 1)[1].split("_", 1)[0])
    return (("x" * 700 if n % 2 else "") + str(n), list(range(n % 300)), float(n))


def _run_and_kill(path: str, run: int, kill_after: int) -> tuple[set[str], set[str]]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, str(run)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written: set[str] = set()
    acked: set[str] = set()
    lines = 0
    deadline = time.monotonic() + 60
    try:
        while lines < kill_after:
            if time.monotonic() > deadline:
                raise AssertionError(f"the child printed only {lines} lines within 60 s")
            ready, _, _ = select.select([child.stdout], [], [], 1.0)
            if not ready:
                continue
            line = child.stdout.readline()
            if not line:
                raise AssertionError(f"the child exited early: {child.stderr.read()[-2000:]}")
            kind, _, rest = line.strip().partition(" ")
            if kind == "W":
                written.update(rest.split(","))
            elif kind == "A":
                acked.update(rest.split(","))
            lines += 1
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return written, acked


@pytest.mark.parametrize("seed, runs", [
    (1, 4),
    pytest.param(2, 12, marks=pytest.mark.slow),
    pytest.param(3, 12, marks=pytest.mark.slow),
])
def test_kill9_loses_no_acknowledged_write_or_ack(tmp_path, seed, runs):
    path = str(tmp_path / "crash.duckdb")
    rng = random.Random(seed)
    all_written: set[str] = set()
    all_acked: set[str] = set()
    for run in range(runs):
        written, acked = _run_and_kill(path, run, kill_after=rng.randint(5, 120))
        assert written, "the child acknowledged no write before the kill"
        all_written |= written
        all_acked |= acked
        s = store.connect(path)
        try:
            rows = s.query("SELECT * FROM t").to_pylist()
            by_id = {r["sample_id"]: r for r in rows}
            missing = all_written - set(by_id)
            assert not missing, f"acknowledged writes lost after kill -9: {sorted(missing)[:5]}"
            for sid in all_written:
                r = by_id[sid]
                assert (r["response"], r["ids"], r["reward"]) == _expected(sid), sid
                assert r["response_status"] and r["ids_status"] and r["reward_status"]
            not_consumed = {sid for sid in all_acked if not by_id[sid]["consumed"]}
            assert not not_consumed, f"acks lost after kill -9: {sorted(not_consumed)[:5]}"
            st = s.stats("t")["t"]
            assert sum(st[k] for k in ("pending", "ready", "processing", "consumed", "stale",
                                       "dead")) == st["rows"] == len(rows)
            # Unacked rows are claimable again after the restart (leases are soft state),
            # and acked ones never are.
            if st["ready"]:
                claim = s.claim("t", 1000)
                assert claim.num_rows == st["ready"]
                assert set(claim.data.column("sample_id").to_pylist()).isdisjoint(all_acked)
                s.nack(claim.claim_id)  # leave them for the next child
        finally:
            s.close()
    assert all_acked, "no ack was acknowledged before any kill; the test checked no ack"
