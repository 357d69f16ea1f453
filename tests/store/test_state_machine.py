"""A hypothesis state machine over puts, claims, acks, nacks, dead-lettering, lease expiry,
version bumps and re-queueing dead rows.

The machine keeps a model of every sample's state and checks the embedded store against it after
every step: claims hand out exactly the first ready rows in order, no row is held by two
claimants, no consumed or stale row is delivered, no row is lost, and the stats add up.

Lease expiry is made deterministic with a fake wall clock for the store (``store.index.time``,
where leases are taken and expire): leases expire when a rule advances the clock and forces ``expire_leases()``, never behind the
model's back.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

import reliability_helpers as rh
import store
import store.index
from store.cache import DEFAULT_CACHE_LIMIT
from store.errors import LeaseExpired, StaleVersion

K = 1                     # max_staleness
MAX_DELIVERIES = 2
STATES = ("pending", "ready", "processing", "consumed", "stale", "dead")
INPUTS = ["a", "b_x"]
SAMPLE_IDS = [f"{i}_{turn}_{traj}" for i in INPUTS for turn in (0, 1) for traj in (0, 1)]
PROMPT, REWARD = 1, 2
COMPLETE = PROMPT | REWARD


class FakeClock:
    """``time`` for the store module, with a wall clock that moves only when told."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@dataclass
class ModelRow:
    sample_id: str
    version: int
    mask: int = 0
    state: str = "pending"
    deliveries: int = 0
    claim: str | None = None

    @property
    def order(self):
        input_id, turn, traj = self.sample_id.rsplit("_", 2)
        return (self.version, input_id, int(turn), int(traj))


@dataclass
class ModelClaim:
    claim_id: str
    keys: list
    expires_at: float
    outcome: str | None = None          # None while held; "acked", "nacked", "expired"


class StoreMachine(RuleBasedStateMachine):
    claims = Bundle("claims")

    #: The claim cache's limit (store/cache.py); the variant below has none: claims read DuckDB.
    cache_limit: int | str = DEFAULT_CACHE_LIMIT

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self._real_time = store.index.time
        store.index.time = self.clock
        self.dir = tempfile.mkdtemp(prefix="expstore-sm-")
        self.s = store.connect(f"{self.dir}/x.duckdb", cache_limit=self.cache_limit)
        self.s.create_table("t", {"prompt": "string", "reward": "float64"}, max_staleness=K,
                            max_deliveries=MAX_DELIVERIES, lease_seconds=10.0)
        self.version = 0
        self.rows: dict[tuple[str, int], ModelRow] = {}
        self.model_claims: dict[str, ModelClaim] = {}

    def teardown(self) -> None:
        try:
            self.s.close()
        finally:
            store.index.time = self._real_time
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- model helpers ---------------------------------------------------------------------
    @property
    def bound(self) -> int:
        return self.version - K

    def _return(self, row: ModelRow) -> None:
        """A nacked or expired row: stale, dead, ready or pending (store's order of checks)."""
        row.claim = None
        if row.version < self.bound:
            row.state = "stale"
        elif row.deliveries >= MAX_DELIVERIES:
            row.state = "dead"
        else:
            row.state = "ready" if row.mask & COMPLETE == COMPLETE else "pending"

    def _held(self) -> list[ModelClaim]:
        return [c for c in self.model_claims.values() if c.outcome is None]

    # -- rules ---------------------------------------------------------------------------------
    @rule(ids=st.lists(st.sampled_from(SAMPLE_IDS), min_size=1, max_size=5, unique=True),
          what=st.sampled_from(["prompt", "reward", "both", "retract"]),
          back=st.integers(0, K))
    def put(self, ids, what, back):
        version = max(self.version - back, 0)
        data: dict = {"sample_id": ids, "policy_version": [version] * len(ids)}
        if what in ("prompt", "both"):
            data["prompt"] = [f"p-{sid}" for sid in ids]
        if what in ("reward", "both"):
            data["reward"] = [1.0] * len(ids)
        if what == "retract":                 # a streamed value that is not complete any more
            data["prompt_status"] = [False] * len(ids)
        result = self.s.put("t", data)
        assert result["rows"] == len(ids)
        set_bits = {"prompt": PROMPT, "reward": REWARD, "both": COMPLETE, "retract": 0}[what]
        clear_bits = PROMPT if what == "retract" else 0
        for sid in ids:
            row = self.rows.setdefault((sid, version), ModelRow(sid, version))
            # (a finished row's values and statuses are written too: a requeue reads them)
            row.mask = (row.mask & ~clear_bits) | set_bits
            if row.state in ("consumed", "stale", "dead"):
                continue                           # a re-send does not resurrect a row
            if row.state == "processing":
                continue
            row.state = "ready" if row.mask & COMPLETE == COMPLETE else "pending"

    @precondition(lambda self: self.version > K)
    @rule(sid=st.sampled_from(SAMPLE_IDS))
    def put_stale(self, sid):
        with pytest.raises(StaleVersion):
            self.s.put("t", {"sample_id": [sid], "policy_version": [self.bound - 1],
                             "reward": [1.0]})

    @rule(sid=st.sampled_from(SAMPLE_IDS))
    def put_future(self, sid):
        with pytest.raises(StaleVersion):
            self.s.put("t", {"sample_id": [sid], "policy_version": [self.version + 1],
                             "reward": [1.0]})

    @rule(target=claims, n=st.integers(1, 6), lease=st.sampled_from([1.0, 5.0, 10.0]))
    def claim(self, n, lease):
        ready = sorted((r for r in self.rows.values() if r.state == "ready"),
                       key=lambda r: r.order)
        expected = ready[:n]
        got = self.s.claim("t", n, lease_seconds=lease, consumer="sm")
        keys = list(zip(got.data.column("sample_id").to_pylist(),
                        got.data.column("policy_version").to_pylist())) if got else []
        # Exactly the first ready rows, in order: so never a held, consumed, stale, dead or
        # pending row.
        assert keys == [(r.sample_id, r.version) for r in expected], (keys, expected)
        if not got:
            assert got.claim_id == ""
            return ""
        assert all(v >= self.bound for _, v in keys)
        assert got.data.column("delivery_count").to_pylist() == [r.deliveries + 1
                                                                 for r in expected]
        assert got.data.column("prompt").to_pylist() == [f"p-{r.sample_id}" for r in expected]
        for r in expected:
            r.state, r.claim = "processing", got.claim_id
            r.deliveries += 1
        self.model_claims[got.claim_id] = ModelClaim(got.claim_id, keys, got.expires_at)
        return got.claim_id

    @rule(claim_id=claims)
    def ack(self, claim_id):
        if not claim_id:
            return
        c = self.model_claims[claim_id]
        if c.outcome in ("nacked", "expired"):
            with pytest.raises(LeaseExpired):
                self.s.ack(claim_id)
            return
        result = self.s.ack(claim_id)
        assert result["acked"] == len(c.keys)
        assert bool(result.get("duplicate")) == (c.outcome == "acked")
        c.outcome = "acked"
        for key in c.keys:
            row = self.rows[key]
            row.state, row.claim = "consumed", None

    @rule(claim_id=claims)
    def nack(self, claim_id):
        if not claim_id:
            return
        c = self.model_claims[claim_id]
        if c.outcome is not None:
            with pytest.raises(LeaseExpired):
                self.s.nack(claim_id)
            return
        assert self.s.nack(claim_id)["nacked"] == len(c.keys)
        c.outcome = "nacked"
        for key in c.keys:
            self._return(self.rows[key])

    @precondition(lambda self: any(r.state == "ready" for r in self.rows.values()))
    @rule(n=st.integers(1, 6))
    def dead_letter(self, n):
        """Claim ready rows and end the claim with them dead (what a cluster's coordinator does
        to rows whose values were lost): dead rows for ``requeue`` besides max_deliveries."""
        claim_id = self.claim(n, 10.0)
        c = self.model_claims[claim_id]
        assert self.s.dead_letter(claim_id)["dead"] == len(c.keys)
        c.outcome = "nacked"
        for key in c.keys:
            row = self.rows[key]
            row.state, row.claim = "dead", None

    @rule(claim_id=claims, lease=st.sampled_from([None, 1.0, 5.0, 20.0]))
    def renew(self, claim_id, lease):
        if not claim_id:
            return
        c = self.model_claims[claim_id]
        if c.outcome is not None:
            with pytest.raises(LeaseExpired):
                self.s.renew(claim_id, lease_seconds=lease)
            return
        answer = self.s.renew(claim_id, lease_seconds=lease)
        # None: the table's lease_seconds (10 s)
        assert answer["expires_at"] == self.clock.now + (10.0 if lease is None else lease)
        c.expires_at = answer["expires_at"]

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0, 11.0]))
    def advance_clock(self, seconds):
        self.clock.now += seconds
        self.s._index.expire_leases()
        for c in self._held():
            if c.expires_at <= self.clock.now:
                c.outcome = "expired"
                for key in c.keys:
                    self._return(self.rows[key])

    @rule(cas=st.booleans())
    def bump(self, cas):
        new = self.s.bump_version("t", expected=self.version if cas else None)
        assert new == self.version + 1
        self.version = new
        for row in self.rows.values():
            if row.state in ("pending", "ready") and row.version < self.bound:
                row.state = "stale"

    @precondition(lambda self: any(r.state == "dead" for r in self.rows.values()))
    @rule(where=st.sampled_from([None, "input_id = 'a'", "turn = 1"]))
    def requeue(self, where):
        def picked(row: ModelRow) -> bool:
            _, input_id, turn, _ = row.order
            return where is None or (input_id == "a" if "input_id" in where else turn == 1)

        dead = [r for r in self.rows.values() if r.state == "dead" and picked(r)]
        answer = self.s.requeue("t", where=where)
        back = [r for r in dead if r.version >= self.bound]
        assert answer == {"table": "t", "requeued": len(back),
                          "skipped_stale": len(dead) - len(back), "skipped_lost": 0}
        for row in back:                           # live again, every delivery to come
            row.deliveries = 0
            row.state = "ready" if row.mask & COMPLETE == COMPLETE else "pending"

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def states_match_the_model(self):
        counts = dict.fromkeys(STATES, 0)
        for row in self.rows.values():
            counts[row.state] += 1
        st_ = self.s.stats("t")["t"]
        got = {k: st_[k] for k in STATES}
        assert got == counts, (got, counts)
        # Every written sample is in exactly one state: nothing lost, nothing doubled.
        assert sum(got.values()) == st_["rows"] == len(self.rows)
        assert st_["version"] == self.version

    @invariant()
    def each_row_held_by_at_most_one_claim(self):
        holders: dict = {}
        for c in self._held():
            for key in c.keys:
                assert key not in holders, f"{key} held by {holders[key]} and {c.claim_id}"
                holders[key] = c.claim_id
                assert self.rows[key].state == "processing"
                assert self.rows[key].claim == c.claim_id

    @invariant()
    def leases_end_when_the_model_says(self):
        got = {lease["claim_id"]: lease["expires_at"] for lease in self.s.leases("t")}
        assert got == {c.claim_id: c.expires_at for c in self._held()}

    @invariant()
    def one_sql_row_per_written_key(self):
        assert rh.rows_and_keys(self.s, "t") == (len(self.rows), len(self.rows))

    @invariant()
    def consumed_rows_are_durable_in_sql(self):
        rows = self.s.query("SELECT sample_id, policy_version FROM t WHERE consumed").to_pylist()
        got = {(r["sample_id"], r["policy_version"]) for r in rows}
        assert got == {k for k, r in self.rows.items() if r.state == "consumed"}


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large])

TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=50, stateful_step_count=40, **SETTINGS)


class UncachedStoreMachine(StoreMachine):
    cache_limit = 0


TestUncachedStoreMachine = UncachedStoreMachine.TestCase
TestUncachedStoreMachine.settings = settings(max_examples=25, stateful_step_count=40, **SETTINGS)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 300 examples of 80 steps: longer than the default limit
def test_store_machine_long():
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(StoreMachine, settings=settings(
        max_examples=300, stateful_step_count=80, **SETTINGS))
