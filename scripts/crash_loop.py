"""Crash loop: SIGKILL the server at random moments under load, restart it on the same files,
and check that nothing acknowledged was lost and nothing was duplicated.

Producer threads put batches of unique samples (a quarter of them large enough to go to the blob
store) and re-send a batch whose put failed (at-least-once, as real producers do). Consumer
threads claim micro-batches and ack most of them; some they leave unacked, as a trainer that died
would. Meanwhile the server is killed with SIGKILL every 0.4–2 s and restarted.

At the end it checks, through the restarted server:

* every put that returned is stored, with the value that was written (blob values included);
* every ack that returned is stored (the rows are consumed), and no consumed row is delivered
  again;
* no row is duplicated: ``count(*) == count(DISTINCT (sample_id, policy_version))``;
* rows claimed but not acked become ready again after their lease and can be claimed and acked,
  until every row is consumed exactly once; after one more kill the counts still hold.

Usage::

    python scripts/crash_loop.py --crashes 100 --dir /tmp/crash   # prints a JSON report

``tests/reliability/test_reliability_crash.py`` runs :func:`run_crash_loop` with 3–5 crashes by default and
with 100 under ``-m slow``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import store  # noqa: E402
from store.errors import ExpstoreError, LeaseExpired, NotFound  # noqa: E402

import reliability_helpers as rh  # noqa: E402

TABLE = "crash"
BATCH = 8
CLAIM = 16


class _Worker(threading.Thread):
    """A thread with its own connection that reconnects (bounded) after the server died."""

    def __init__(self, name: str, uri: str, stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.uri = uri
        self.stop_event = stop
        self.s: Any = None
        self.errors = 0          # failed calls (expected: the server was killed under them)
        self.reconnects = 0
        self.fatal: BaseException | None = None

    def connect(self) -> bool:
        """(Re)open the connection; False if asked to stop first. A fresh client each time, so
        that gRPC's reconnect back-off after a dead server does not delay the next call."""
        if self.s is not None:
            try:
                self.s.close()
            except Exception:  # noqa: BLE001
                pass
            self.s = None
        deadline = time.monotonic() + 120
        while not self.stop_event.is_set():
            try:
                self.s = store.connect(self.uri, timeout=15.0, connect_timeout=1.0)
                self.reconnects += 1
                return True
            except ExpstoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return False

    def run(self) -> None:
        try:
            if self.connect():
                self.work()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.fatal = e
        finally:
            if self.s is not None:
                self.s.close()

    def work(self) -> None:  # each worker kind says what it does
        raise TypeError(f"{type(self).__name__} must define work()")


class Producer(_Worker):
    def __init__(self, index: int, uri: str, stop: threading.Event) -> None:
        super().__init__(f"producer-{index}", uri, stop)
        self.index = index
        self.acked: set[str] = set()       # put returned: must be stored
        self.attempted: set[str] = set()   # sent at least once: may be stored

    def work(self) -> None:
        seq = 0
        for _ in range(1_000_000):
            if self.stop_event.is_set():
                return
            ids = rh.sample_ids(f"p{self.index}n", seq, BATCH)
            self.attempted.update(ids)
            data = {"sample_id": ids,
                    "response": [rh.response_of(i, n % 4 == 0) for n, i in enumerate(ids)],
                    "reward": [rh.reward_of(i) for i in ids]}
            try:
                self.s.put(TABLE, data)
            except ExpstoreError:
                self.errors += 1
                if not self.connect():
                    return
                continue  # re-send the same batch: writes are idempotent upserts
            self.acked.update(ids)
            seq += BATCH


class Consumer(_Worker):
    def __init__(self, index: int, uri: str, stop: threading.Event, lease_seconds: float,
                 rng: random.Random, skip_ack: float) -> None:
        super().__init__(f"consumer-{index}", uri, stop)
        self.lease_seconds = lease_seconds
        self.rng = rng
        self.skip_ack = skip_ack
        self.acked: set[str] = set()        # ack returned: must be consumed
        self.unacked: set[str] = set()      # claimed, ack not sent or not answered
        self.bad_values: list[str] = []
        self.redelivered_after_ack: list[str] = []
        self.lock = threading.Lock()

    def work(self) -> None:
        for _ in range(1_000_000):
            if self.stop_event.is_set():
                return
            try:
                claim = self.s.claim(TABLE, CLAIM, consumer=self.name,
                                     lease_seconds=self.lease_seconds)
            except ExpstoreError:
                self.errors += 1
                if not self.connect():
                    return
                continue
            if not claim:
                self.stop_event.wait(0.02)
                continue
            ids = self.check(claim.data)
            if self.rng.random() < self.skip_ack:
                self.unacked.update(ids)  # a trainer that "died" holding this micro-batch
                continue
            try:
                self.s.ack(claim.claim_id)
            except (LeaseExpired, NotFound):
                self.unacked.update(ids)  # the lease ended in a crash; rows come back
                continue
            except ExpstoreError:
                self.errors += 1
                self.unacked.update(ids)  # unknown whether the ack committed
                if not self.connect():
                    return
                continue
            self.acked.update(ids)
            self.unacked.difference_update(ids)

    def check(self, data: Any) -> list[str]:
        ids = data.column("sample_id").to_pylist()
        for sid, reward, response in zip(ids, data.column("reward").to_pylist(),
                                         data.column("response").to_pylist()):
            if reward != rh.reward_of(sid) or response not in (rh.response_of(sid, True),
                                                               rh.response_of(sid, False)):
                self.bad_values.append(sid)
            if sid in self.acked:
                self.redelivered_after_ack.append(sid)
        return ids


def run_crash_loop(workdir: str | Path, crashes: int, *, seed: int = 0, producers: int = 2,
                   consumers: int = 2, min_up: float = 0.4, max_up: float = 2.0,
                   lease_seconds: float = 1.0, skip_ack: float = 0.2,
                   log: Callable[[str], Any] = lambda m: None) -> dict[str, Any]:
    """Run the loop (see the module docstring); return a report, raise AssertionError on a
    violation."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    t_start = time.monotonic()
    srv = rh.ServerProcess(workdir / "crash.duckdb", log_path=workdir / "server.log")
    srv.start()
    stop = threading.Event()
    workers: list[_Worker] = []
    restart_seconds: list[float] = []
    try:
        with store.connect(srv.uri) as admin:
            admin.create_table(TABLE, {"response": "string", "reward": "float64"},
                               if_not_exists=True, lease_seconds=lease_seconds,
                               max_deliveries=1000)
        prods = [Producer(i, srv.uri, stop) for i in range(producers)]
        cons = [Consumer(i, srv.uri, stop, lease_seconds, random.Random(seed * 100 + i),
                         skip_ack) for i in range(consumers)]
        workers = [*prods, *cons]
        for w in workers:
            w.start()
        for n in range(crashes):
            stop.wait(rng.uniform(min_up, max_up))
            srv.kill()
            t0 = time.monotonic()
            srv.start()
            restart_seconds.append(time.monotonic() - t0)
            log(f"crash {n + 1}/{crashes}: restarted in {restart_seconds[-1]:.2f} s; "
                f"acked puts {sum(len(p.acked) for p in prods)}, "
                f"acked rows {sum(len(c.acked) for c in cons)}")
            _raise_fatal(workers)
        stop.wait(min_up)
        stop.set()
        for w in workers:
            w.join(timeout=60)
            assert not w.is_alive(), f"{w.name} did not stop within 60 s"
        _raise_fatal(workers)
        report = _verify(srv, prods, cons, lease_seconds)
    finally:
        stop.set()
        srv.stop()
    report.update({
        "crashes": crashes, "seconds": round(time.monotonic() - t_start, 1),
        "restart_seconds_mean": round(sum(restart_seconds) / max(len(restart_seconds), 1), 2),
        "restart_seconds_max": round(max(restart_seconds, default=0.0), 2),
        "failed_calls": sum(w.errors for w in workers),
        "reconnects": sum(w.reconnects for w in workers),
    })
    return report


def _raise_fatal(workers: list[_Worker]) -> None:
    for w in workers:
        if w.fatal is not None:
            raise AssertionError(f"{w.name} failed: {w.fatal!r}") from w.fatal


def _verify(srv: rh.ServerProcess, prods: list[Producer], cons: list[Consumer],
            lease_seconds: float) -> dict[str, Any]:
    acked_puts = set().union(*(p.acked for p in prods))
    attempted = set().union(*(p.attempted for p in prods))
    acked_acks = set().union(*(c.acked for c in cons))
    unacked = set().union(*(c.unacked for c in cons)) - acked_acks
    bad = [sid for c in cons for sid in c.bad_values]
    assert not bad, f"claims returned wrong values for {bad[:10]}"
    redelivered = [sid for c in cons for sid in c.redelivered_after_ack]
    assert not redelivered, f"acked rows delivered again: {redelivered[:10]}"

    with store.connect(srv.uri) as s:
        rows = s.query(f'SELECT sample_id, policy_version, reward, consumed FROM "{TABLE}"')
        counts = s.query(rh.table_checksum_sql(TABLE, ["sample_id"])).to_pylist()[0]
        assert counts["n"] == counts["keys"] == rows.num_rows, \
            f"duplicated rows: {counts['n']} rows, {counts['keys']} distinct keys"
        stored = dict(zip(rows.column("sample_id").to_pylist(),
                          rows.column("reward").to_pylist()))
        consumed = {sid for sid, c in zip(rows.column("sample_id").to_pylist(),
                                          rows.column("consumed").to_pylist()) if c}
        lost = acked_puts - stored.keys()
        assert not lost, f"{len(lost)} acknowledged writes lost, e.g. {sorted(lost)[:10]}"
        phantom = stored.keys() - attempted
        assert not phantom, f"rows nobody wrote: {sorted(phantom)[:10]}"
        wrong = [sid for sid, r in stored.items() if r != rh.reward_of(sid)]
        assert not wrong, f"stored values differ from the written ones: {wrong[:10]}"
        lost_acks = acked_acks - consumed
        assert not lost_acks, f"{len(lost_acks)} acknowledged acks lost, e.g. " \
                              f"{sorted(lost_acks)[:10]}"
        # Unacked rows (and unanswered puts' rows) come back after their lease: drain it all.
        drained, redelivered_unacked = _drain(s, acked_acks, lease_seconds)
        rows_total = len(stored)
        st = s.stats(TABLE)[TABLE]
        assert st["consumed"] == rows_total and st["ready"] == st["processing"] == \
            st["pending"] == 0, f"after the drain: {st}, {rows_total} rows"
        came_back = unacked & drained
        # An unacked row not drained was consumed by an ack whose answer the crash swallowed.
        swallowed = unacked - drained
        assert swallowed <= consumed, \
            f"claimed, unacked rows neither redelivered nor consumed: " \
            f"{sorted(swallowed - consumed)[:10]}"
    # One more crash after the drain: every ack of the drain is durable.
    srv.kill()
    srv.start()
    with store.connect(srv.uri) as s:
        st = s.stats(TABLE)[TABLE]
        assert st["consumed"] == rows_total == st["rows"] and st["ready"] == 0, st
    return {"rows": rows_total, "acked_put_rows": len(acked_puts),
            "acked_ack_rows": len(acked_acks), "unacked_claimed_rows": len(unacked),
            "unacked_redelivered": len(came_back), "unacked_consumed_by_lost_answer":
            len(swallowed), "drained_rows": len(drained),
            "redelivered_during_drain": redelivered_unacked, "lost": 0, "duplicated": 0}


def _drain(s: Any, acked: set[str], lease_seconds: float) -> tuple[set[str], int]:
    """Claim and ack everything left (waiting out leases); return what was delivered."""
    drained: set[str] = set()
    redelivered = 0
    deadline = time.monotonic() + lease_seconds * 3 + 60
    while time.monotonic() < deadline:
        claim = s.claim(TABLE, 256, consumer="drain")
        if not claim:
            st = s.stats(TABLE)[TABLE]
            if st["ready"] == st["processing"] == st["pending"] == 0:
                return drained, redelivered
            time.sleep(0.05)
            continue
        ids = claim.data.column("sample_id").to_pylist()
        again = set(ids) & acked
        assert not again, f"acked rows delivered again after restart: {sorted(again)[:10]}"
        for sid, reward, response in zip(ids, claim.data.column("reward").to_pylist(),
                                         claim.data.column("response").to_pylist()):
            assert reward == rh.reward_of(sid), sid
            assert response in (rh.response_of(sid, True), rh.response_of(sid, False)), sid
        redelivered += sum(1 for d in claim.data.column("delivery_count").to_pylist() if d > 1)
        drained.update(ids)
        s.ack(claim.claim_id)
    raise AssertionError(f"rows still not consumed after the drain deadline: {s.stats(TABLE)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crashes", type=int, default=100)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--lease-seconds", type=float, default=1.0)
    args = ap.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="expstore-crash-")
    report = run_crash_loop(workdir, args.crashes, seed=args.seed, producers=args.producers,
                            consumers=args.consumers, lease_seconds=args.lease_seconds,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
