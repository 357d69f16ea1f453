"""Bad input, fuzzed: every malformed call to a running server gets a Flight error, quickly.

Hypothesis drives raw ``pyarrow.flight`` calls (no expstore client in between) against one server
subprocess: malformed and mistyped action bodies, missing and extra fields, unknown actions and
tables, ``do_put`` batches with missing/extra/mistyped columns, nulls, huge strings, deeply nested
lists, invalid sample ids, out-of-range limits, future and stale policy versions, bad tickets and
bad ``do_exchange`` commands. Every generated call is invalid by construction, so each must:

* fail with a Flight error raised by the server (not a client-side deadline, not UNAVAILABLE: the
  connection must not drop), carrying a typed store error code (never ``internal``);
* leave the server up (``health`` answers after every call);
* leave the stored data exactly as it was: a checksum over every row and column of every table,
  the versions and the claim/queue counters is compared after every call.

The default run tries a few hundred calls; ``-m slow`` tries 12,000.
"""
from __future__ import annotations

import json
import re
import string
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import store
from flight_server.flightsql.handler import REFUSED_ACTIONS as REFUSED_SQL_ACTIONS

import reliability_helpers as rh

CALL_TIMEOUT = 20.0
TABLES = ("fz", "fz_other")
CURRENT_VERSION = 3
MAX_STALENESS = 1
# The server's pattern: no control characters, turn and trajectory without leading zeros.
SAMPLE_ID = re.compile(r"[^\x00-\x1f\x7f-\x9f]+_(0|[1-9][0-9]{0,8})_(0|[1-9][0-9]{0,8})")


def _valid_identifier(name: str) -> bool:
    from store.errors import InvalidArgument
    from store.naming import check_identifier
    try:
        check_identifier(name, "table")
    except InvalidArgument:
        return False
    return True


def _valid_sample_id(sid: str) -> bool:
    return SAMPLE_ID.fullmatch(sid) is not None and len(sid) <= 512
FUZZ_SETTINGS = dict(deadline=None, derandomize=False, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the server under test ---------------------------------------------------------------------
class Target:
    def __init__(self, srv: rh.ServerProcess) -> None:
        self.srv = srv
        self.client = flight.FlightClient(srv.uri)
        self.store = store.connect(srv.uri)
        self.options = flight.FlightCallOptions(timeout=CALL_TIMEOUT)
        self.baseline: dict[str, Any] = {}
        self.calls = 0
        self.codes: dict[str, int] = {}

    def snapshot(self) -> dict[str, Any]:
        stats = self.store.stats()
        counters = {t: {k: v for k, v in s.items() if k != "rows_per_version"}
                    for t, s in stats.items()}
        return {"tables": rh.store_checksum(self.store), "stats": counters,
                "leases": self.store.leases()}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    srv = rh.ServerProcess(tmp_path_factory.mktemp("fuzz") / "fuzz.duckdb").start()
    t = Target(srv)
    s = t.store
    s.create_table("fz", {"response": "string", "reward": "float64",
                          "token_ids": "list<int32>", "next_agent_id": "int32"},
                   max_staleness=MAX_STALENESS, lease_seconds=60.0)
    s.create_table("fz_other", {"obs": "tensor<float32>", "done": "bool"})
    for version in range(CURRENT_VERSION + 1):
        ids = rh.sample_ids(f"v{version}q", 0, 12, turn=version)
        s.put("fz", {"sample_id": ids,
                     "response": [rh.response_of(i, n % 3 == 0) for n, i in enumerate(ids)],
                     "reward": [rh.reward_of(i) for i in ids],
                     "token_ids": [[n, n + 1, n + 2] for n in range(len(ids))],
                     "next_agent_id": [n % 2 for n in range(len(ids))]})
        if version < CURRENT_VERSION:
            s.bump_version("fz")
    # Some rows consumed, some pending (a required column missing), most ready.
    claim = s.claim("fz", 4)
    s.ack(claim.claim_id)
    s.put("fz", {"sample_id": rh.sample_ids("pend", 0, 3), "reward": [0.5, 0.5, 0.5]})
    import numpy as np
    from store import tensors
    s.put("fz_other", {"sample_id": rh.sample_ids("o", 0, 5),
                       "obs": tensors.to_arrow([np.ones((2, 3), np.float32) * i
                                                for i in range(5)]),
                       "done": [True, False, True, False, True]})
    t.known_actions = {a.type for a in t.client.list_actions()}
    t.baseline = t.snapshot()
    yield t
    t.client.close()
    t.store.close()
    srv.stop()
    print(f"\nfuzz: {t.calls} invalid calls; error codes seen: {dict(sorted(t.codes.items()))}")


# -- one invalid call --------------------------------------------------------------------------
@dataclass
class Call:
    """An invalid call: ``run(client, options)`` must raise a Flight error."""

    kind: str
    describe: str
    run: Callable[[flight.FlightClient, flight.FlightCallOptions], Any]

    def __repr__(self) -> str:
        return f"<{self.kind}: {self.describe[:300]}>"


def _code(error: BaseException) -> str:
    extra = getattr(error, "extra_info", None)
    if extra:
        try:
            return str(json.loads(bytes(extra)).get("code"))
        except (ValueError, AttributeError):
            pass
    return f"({type(error).__name__})"


def check_call(target: Target, call: Call) -> str:
    """Run one invalid call and check the server after it; the error code it answered."""
    target.calls += 1
    t0 = time.monotonic()
    try:
        result = call.run(target.client, target.options)
    except (flight.FlightUnavailableError, flight.FlightTimedOutError) as e:
        raise AssertionError(f"{call!r}: the connection dropped or the call hung "
                             f"({time.monotonic() - t0:.1f} s): {e!r}") from e
    except (flight.FlightError, pa.ArrowException, InStreamError) as e:
        code = _code(e)
        target.codes[code] = target.codes.get(code, 0) + 1
        assert code != "internal", f"{call!r}: an unhandled server error: {e}"
    else:
        raise AssertionError(f"{call!r} was accepted: {result!r}")
    assert time.monotonic() - t0 < CALL_TIMEOUT / 2, f"{call!r} took too long"
    assert rh.health(target.srv.uri, timeout=10) is not None, \
        f"the server stopped answering after {call!r}:\n{target.srv.log_tail()}"
    after = target.snapshot()
    assert after == target.baseline, f"{call!r} changed the stored data"
    return code


# -- value strategies ---------------------------------------------------------------------------
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False), st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
not_a_string = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.lists(json_scalars, max_size=3),
                         st.dictionaries(st.text(max_size=5), json_scalars, max_size=3))
not_an_int = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False).filter(
    lambda f: f != int(f) if f == f and abs(f) < 1e300 else True), st.text(max_size=10),
    st.lists(st.integers(), max_size=3))
unknown_table = st.one_of(
    st.from_regex(r"\A[a-z_][a-z0-9_]{0,20}\Z").filter(lambda n: n not in TABLES),
    st.text(min_size=1, max_size=80).filter(lambda n: n not in TABLES),
    st.sampled_from(['fz"; DROP TABLE fz; --', "fz ", "FZ", "_expstore_tables", "alembic_version",
                     "main.fz", "../fz", "fz\x00", "x" * 5000]))
# (Not "sample_id": a meta column's name is a bad column name but a fine table name; bad column
# names of that kind are poisons of their own below. Nor SQL keywords: names are always quoted.)
bad_identifier = st.one_of(
    st.sampled_from(["", "1abc", "a b", "a-b", 'x"y', "x;y", "é", "a" * 300, "_expstore_x"]),
    st.text(min_size=1, max_size=20).filter(lambda n: not _valid_identifier(n)))
unknown_field = st.from_regex(r"\Azz[a-z_]{0,10}\Z")
bad_limit = st.one_of(st.integers(max_value=0), st.integers(min_value=100_001), not_an_int)
bad_seconds = st.one_of(st.floats(max_value=0, allow_nan=False), st.floats(min_value=1e6),
                        st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2))
# issue #29: a consumer that is not a string (or not a printable name of at most 256 characters)
bad_consumer = st.one_of(
    not_a_string.filter(lambda v: v is not None),
    st.sampled_from(["t\x00", "trainer\n0", "\x1b[2J", "x" * 300]))
malicious_predicates = st.sampled_from([
    "1=1; DROP TABLE fz", "reward > 0; UPDATE fz SET consumed = true",
    "sample_id IN (SELECT * FROM read_csv('/etc/passwd'))", "getenv('HOME') IS NOT NULL",
    "(SELECT count(*) FROM glob('/*')) > 0", "nosuchcolumn > 1", "reward >", "))", "'",
    "reward > (SELECT query('DROP TABLE fz'))", "", "   ", "read_text('/etc/hosts') = ''",
    # issue #29: predicates that change the claim's query around them, or read the server
    "reward > 0) ORDER BY (1", "reward > 0) LIMIT (1", "reward > 0), (1", "reward > ?",
    "reward > 0) FROM fz WHERE (1", "sample_id IN (SELECT path FROM duckdb_databases)",
    "(SELECT count(*) FROM pg_settings) > 0", "current_setting('temp_directory') <> ''",
])


def _constants(values: list[Any]) -> st.SearchStrategy:
    """``sampled_from`` without printing every (possibly huge) value in failure reports."""
    return st.integers(0, len(values) - 1).map(lambda i: values[i])


def _poisoned(valid: dict[str, Any], poisons: list[st.SearchStrategy]) -> st.SearchStrategy:
    """``valid`` with one poison applied: each poison strategy yields a function body -> body."""
    return st.tuples(st.just(valid), st.one_of(*poisons)).map(lambda vp: vp[1](dict(vp[0])))


def _set(field: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return values.map(lambda v: (lambda b: {**b, field: v}))


def _drop(field: str) -> st.SearchStrategy:
    return st.just(lambda b: {k: v for k, v in b.items() if k != field})


def _extra() -> st.SearchStrategy:
    return st.tuples(unknown_field, json_values).map(lambda kv: (lambda b: {**b, kv[0]: kv[1]}))


# Bodies of each action, each invalid by construction (one poison applied to a valid body).
ACTION_BODIES: dict[str, st.SearchStrategy] = {
    "create_table": _poisoned({"name": "brand_new", "columns": {"a": "float64"}}, [
        _extra(), _drop("name"), _drop("columns"), _set("name", bad_identifier),
        _set("name", st.sampled_from(list(TABLES))), _set("name", not_a_string),
        _set("columns", st.one_of(st.lists(st.text(max_size=4), max_size=3), st.text(max_size=8),
                                  st.integers(), st.just({}))),
        _set("columns", st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(
            st.sampled_from(["floaty", "list<", "list<nope>", "tensor<string>", "int128", "",
                             "map<int32,int32>", "decimal(1000,2)"]), st.integers(),
            st.lists(st.integers(), max_size=2)), min_size=1, max_size=2)),
        _set("columns", st.dictionaries(bad_identifier, st.just("float64"), min_size=1,
                                        max_size=2)),
        _set("columns", st.just({"a_status": "bool"})),
        _set("columns", st.just({"sample_id": "string"})),
        # issue #29: names that differ only in case are one name in SQL
        _set("columns", st.sampled_from([{"a": "int64", "A": "int64"}, {"Sample_ID": "string"},
                                         {"Row_Id": "int64"}, {"x": "int64", "X_STATUS": "bool"},
                                         {"Reward_Status": "bool"}])),
        _set("name", st.sampled_from(["FZ", "Fz", "FZ_OTHER", "fz_OTHER"])),
        _set("max_staleness", st.one_of(st.integers(max_value=-1), not_an_int)),
        _set("max_deliveries", st.one_of(st.integers(max_value=0), not_an_int)),
        _set("lease_seconds", bad_seconds),
        _set("storage", st.one_of(st.just({"a": "sideways"}), st.just({"nope": "ref"}),
                                  st.integers(), st.text(max_size=4))),
        _set("required", st.one_of(st.just(["nope"]), st.integers(), st.text(min_size=1,
                                                                             max_size=4))),
        _set("version_group", st.one_of(bad_identifier, st.integers(), st.lists(st.integers()))),
        _set("if_not_exists", st.one_of(st.integers(2, 9), st.text(min_size=1, max_size=3))),
    ]),
    "drop_table": _poisoned({"name": "no_such_table"}, [
        _extra(), _drop("name"), _set("name", unknown_table), _set("name", not_a_string),
        _set("if_exists", st.one_of(st.text(min_size=1, max_size=3), st.integers(2, 9))),
    ]),
    "claim": _poisoned({"table": "fz", "limit": 4}, [
        _extra(), _drop("table"), _drop("limit"), _set("table", unknown_table),
        _set("table", not_a_string), _set("limit", bad_limit),
        _set("where", st.one_of(malicious_predicates, not_a_string.filter(lambda v: v is not None))),
        _set("group_by", st.one_of(st.sampled_from(["reward", "sample_id", "", "turn"]),
                                   st.integers())),
        _set("group_size", st.one_of(st.integers(max_value=0), st.integers(min_value=5),
                                     not_an_int.filter(lambda v: v is not None))),
        _set("min_rows", st.one_of(st.integers(max_value=0), st.integers(min_value=5),
                                   not_an_int.filter(lambda v: v is not None))),
        _set("lease_seconds", st.one_of(st.floats(max_value=0, allow_nan=False),
                                        st.floats(min_value=86401), st.text(max_size=4),
                                        st.lists(st.integers(), max_size=2), st.booleans())),
        _set("consumer", bad_consumer),
    ]),
    "claim_many": _poisoned({"requests": [{"table": "fz", "limit": 2}]}, [
        _extra(), _drop("requests"),
        _set("requests", st.one_of(st.just([]), st.text(max_size=5), st.integers(),
                                   st.dictionaries(st.text(max_size=3), json_scalars))),
        _set("requests", st.just([{"table": "fz", "limit": 2}, {"table": "fz", "limit": 2}])),
        _set("requests", st.lists(st.one_of(
            st.dictionaries(st.sampled_from(["table", "limit", "where", "zz"]), json_scalars),
            json_scalars), min_size=1, max_size=3).filter(
            lambda rs: any(not isinstance(r, dict) or "zz" in r or "table" not in r
                           or r.get("table") not in TABLES or "limit" not in r
                           or not isinstance(r.get("limit"), int)
                           or isinstance(r.get("limit"), bool)
                           or not 1 <= r["limit"] <= 100_000 or "where" in r
                           for r in rs))),
        _set("lease_seconds", st.one_of(st.floats(max_value=0, allow_nan=False),
                                        st.floats(min_value=86401), st.text(max_size=4),
                                        st.booleans())),
        _set("consumer", bad_consumer),
    ]),
    "ack": _poisoned({"claim_id": "0" * 32}, [
        _extra(), _drop("claim_id"), _set("claim_id", not_a_string),
        _set("claim_id", st.one_of(st.just(""), st.uuids().map(lambda u: u.hex),
                                   st.text(max_size=100))),
    ]),
    "nack": _poisoned({"claim_id": "0" * 32}, [
        _extra(), _drop("claim_id"), _set("claim_id", not_a_string),
        _set("claim_id", st.one_of(st.just(""), st.uuids().map(lambda u: u.hex),
                                   st.text(max_size=100))),
    ]),
    "bump_version": _poisoned({"table": "fz", "expected": CURRENT_VERSION + 7}, [
        _extra(), _set("table", unknown_table), _set("table", not_a_string),
        _set("expected", st.one_of(st.integers().filter(lambda v: v != CURRENT_VERSION),
                                   not_an_int.filter(lambda v: v is not None))),
        st.tuples(not_a_string.filter(lambda v: v is not None)).map(
            lambda w: (lambda b: {"table": "fz", "weights_uri": w[0]})),
    ]),
    "get_version": _poisoned({"table": "fz_missing"}, [
        _extra().map(lambda f: (lambda b: f({"table": "fz"}))), _drop("table"),
        _set("table", unknown_table), _set("table", not_a_string)]),
    "wait_version": _poisoned({"table": "fz", "min_version": 99, "timeout": -1}, [
        _set("timeout", st.one_of(st.floats(max_value=-0.001, allow_nan=False),
                                  st.floats(min_value=300.001), st.text(max_size=3),
                                  st.booleans(), st.lists(st.integers(), max_size=2))),
        st.tuples(not_an_int.filter(lambda v: v is not None)).map(
            lambda m: (lambda b: {"table": "fz", "min_version": m[0], "timeout": 0.1})),
        st.tuples(unknown_table).map(
            lambda t: (lambda b: {"table": t[0], "min_version": 1, "timeout": 0.1})),
        _extra().map(lambda f: (lambda b: f({"table": "fz", "min_version": 1, "timeout": 0}))),
        st.just(lambda b: {"table": "fz", "timeout": 0}),
    ]),
    "stats": _poisoned({}, [_extra(), _set("table", unknown_table),
                            _set("table", not_a_string.filter(lambda v: v is not None))]),
    "leases": _poisoned({}, [_extra(), _set("table", not_a_string.filter(
        lambda v: v is not None and not (isinstance(v, str))))]),
    "describe": _poisoned({"table": "fz_missing"}, [
        _extra().map(lambda f: (lambda b: f({"table": "fz"}))), _drop("table"),
        _set("table", unknown_table), _set("table", not_a_string)]),
    "list_tables": _poisoned({}, [_extra()]),
    "health": _poisoned({}, [_extra()]),
    "gc": _poisoned({}, [_extra()]),
    "checkpoint": _poisoned({}, [_extra()]),
}


def action_call(name: str, body: Any, raw: bytes | None = None) -> Call:
    payload = raw if raw is not None else json.dumps(body).encode()

    def run(client: flight.FlightClient, options: flight.FlightCallOptions) -> Any:
        return [r.body.to_pybytes() for r in client.do_action(flight.Action(name, payload),
                                                              options)]
    return Call("action", f"{name} {payload[:300]!r}", run)


def _not_json_object(raw: bytes) -> bool:
    if not raw:
        return False  # an empty body means {}: a valid call of gc, health, …
    try:
        return not isinstance(json.loads(raw), dict)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return True


bad_action_bodies = st.builds(
    lambda name, raw: action_call(name, None, raw), st.sampled_from(sorted(ACTION_BODIES)),
    st.one_of(st.binary(min_size=1, max_size=200),
              json_values.map(lambda v: json.dumps(v).encode()),
              _constants([b"{", b"{'table': 'fz'}", b"null", b"[]", b"\xff\xfe{}",
                          b'{"table": "fz"', b"{}" * 1000, b"[" * 5000 + b"]" * 5000,
                          b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"name": "x"}' + b" " * (1 << 20)])
              ).filter(_not_json_object))

bad_action_fields = st.sampled_from(sorted(ACTION_BODIES)).flatmap(
    lambda name: ACTION_BODIES[name].map(lambda body: action_call(name, body)))


@st.composite
def unknown_actions(draw) -> Call:
    known = set(ACTION_BODIES) | _flight_sql_actions()
    name = draw(st.one_of(st.text(max_size=40), st.sampled_from(
        ["Claim", "ACK", "claim ", "drop", "sql", "exec", "__init__", "shutdown", ""])).filter(
        lambda n: n not in known))
    return action_call(name, draw(st.dictionaries(st.text(max_size=5), json_scalars,
                                                   max_size=3)))


def _flight_sql_actions() -> set[str]:
    from flight_server.flightsql.handler import ACTIONS as SQL_ACTIONS, REFUSED_ACTIONS
    return set(SQL_ACTIONS) | set(REFUSED_ACTIONS)


# -- do_put -----------------------------------------------------------------------------------
def valid_rows(prefix: str, n: int) -> dict[str, list]:
    ids = rh.sample_ids(prefix, 0, n)
    return {"sample_id": ids, "response": ["ok"] * n, "reward": [1.0] * n,
            "token_ids": [[1, 2]] * n, "next_agent_id": [0] * n}


FZ_TYPES = {"sample_id": pa.string(), "response": pa.string(), "reward": pa.float64(),
            "token_ids": pa.list_(pa.int32()), "next_agent_id": pa.int32(),
            "policy_version": pa.int64()}


def _batch(columns: dict[str, Any], types: dict[str, pa.DataType] | None = None,
           names: list[str] | None = None) -> pa.RecordBatch:
    types = {**FZ_TYPES, **(types or {})}
    arrays = [v if isinstance(v, (pa.Array, pa.ChunkedArray)) else
              pa.array(v, type=types.get(k)) for k, v in columns.items()]
    return pa.RecordBatch.from_arrays(arrays, names=names or list(columns))


@st.composite
def bad_batches(draw) -> tuple[str, pa.RecordBatch]:
    """A batch of fresh samples with exactly one way to be invalid (some rows may be fine)."""
    n = draw(st.integers(1, 6))
    prefix = "fuzz" + draw(st.from_regex(r"\A[a-z]{1,6}\Z"))
    rows = valid_rows(prefix, n)
    bad_row = draw(st.integers(0, n - 1))
    kind = draw(st.sampled_from([
        "no_sample_id", "extra_column", "meta_column", "wrong_type", "null_sample_id",
        "bad_sample_id", "long_sample_id", "huge_string_bad_id", "nested_lists",
        "future_version", "stale_version", "null_list_type", "duplicate_column",
        "int_overflow", "status_wrong_type", "version_wrong_type", "sample_id_wrong_type",
        "lossy_cast", "leading_zero_id", "control_char_id"]))
    if kind == "no_sample_id":
        del rows["sample_id"]
        return kind, _batch(rows)
    if kind == "extra_column":
        name = draw(st.one_of(unknown_field, st.sampled_from(["rewards", "Reward", "response__ref",
                                                              "token_ids__w", "x_status"])))
        return kind, _batch({**rows, name: draw(st.lists(json_scalars.filter(
            lambda v: not isinstance(v, (int, float)) or isinstance(v, bool)), min_size=n,
            max_size=n).map(lambda vs: [str(v) for v in vs]))}, {name: pa.string()})
    if kind == "meta_column":
        name = draw(st.sampled_from(["row_id", "consumed", "is_processing", "lease_id",
                                     "delivery_count", "dead", "stale", "input_id", "turn",
                                     "created_at"]))
        return kind, _batch({**rows, name: [1] * n}, {name: pa.int64()})
    if kind == "wrong_type":
        column, values, typ = draw(st.sampled_from([
            ("reward", [f"x{i}" for i in range(n)], pa.string()),
            ("reward", [[1.0]] * n, pa.list_(pa.float64())),
            ("token_ids", ["not a list"] * n, pa.string()),
            ("token_ids", [1] * n, pa.int32()),
            ("next_agent_id", [f"agent{i}" for i in range(n)], pa.string()),
            ("response", [{"a": 1}] * n, pa.struct([("a", pa.int64())])),
            ("token_ids", [["a", "b"]] * n, pa.list_(pa.string())),
        ]))
        rows[column] = values
        return kind, _batch(rows, {column: typ})
    if kind == "lossy_cast":  # issue #29: a value that would be stored as something else
        column, values, typ = draw(st.sampled_from([
            ("reward", [True] * n, pa.bool_()),
            ("next_agent_id", [i % 2 == 0 for i in range(n)], pa.bool_()),
            ("response", [1.5 + i for i in range(n)], pa.float64()),
            ("response", [i for i in range(n)], pa.int64()),
            ("response", [19000 + i for i in range(n)], pa.date32()),
            ("next_agent_id", [str(i) for i in range(n)], pa.string()),
            ("token_ids", [[True, False]] * n, pa.list_(pa.bool_())),
            ("reward_status", [1] * n, pa.int64()),
        ]))
        rows[column] = values
        return kind, _batch(rows, {column: typ})
    if kind == "leading_zero_id":  # issue #29: would be a second row of the same trajectory
        prefix_id = rows["sample_id"][bad_row].rsplit("_", 2)[0]
        rows["sample_id"][bad_row] = draw(st.sampled_from(
            [f"{prefix_id}_00_0", f"{prefix_id}_0_00", f"{prefix_id}_01_2",
             f"{prefix_id}_0_000000007"]))
        return kind, _batch(rows)
    if kind == "control_char_id":
        char = draw(st.sampled_from(["\x00", "\x01", "\t", "\r", "\x1b", "\x7f", "\x85"]))
        sid = rows["sample_id"][bad_row]
        at = draw(st.integers(0, len(sid)))
        rows["sample_id"][bad_row] = sid[:at] + char + sid[at:]
        return kind, _batch(rows)
    if kind == "null_sample_id":
        rows["sample_id"][bad_row] = None
        return kind, _batch(rows)
    if kind == "bad_sample_id":
        rows["sample_id"][bad_row] = draw(st.one_of(
            st.text(max_size=40), st.sampled_from(["", "_0_0", "q_0", "q_-1_0", "q_0_-1",
                                                   "q_1.5_0", "q_0_0_", "q__", "q_0_0x",
                                                   "q_1234567890_0", "q_\u0663_0", "q\n_0_0"])
        ).filter(lambda sid: not _valid_sample_id(sid)))
        return kind, _batch(rows)
    if kind == "long_sample_id":
        rows["sample_id"][bad_row] = "q" * draw(st.integers(510, 5000)) + "_0_0"
        return kind, _batch(rows)
    if kind == "huge_string_bad_id":
        rows["response"][bad_row] = "x" * draw(st.integers(1 << 20, 8 << 20))
        rows["sample_id"][bad_row] = "not-a-sample-id"
        return kind, _batch(rows)
    if kind == "nested_lists":
        depth = draw(st.integers(2, 40))
        value: Any = [1, 2]
        typ: pa.DataType = pa.list_(pa.int32())
        for _ in range(depth - 1):
            value, typ = [value], pa.list_(typ)
        rows["token_ids"] = [value] * n
        return kind, _batch(rows, {"token_ids": typ})
    if kind == "future_version":
        v = draw(st.integers(CURRENT_VERSION + 1, 2**62))
        return kind, _batch({**rows, "policy_version": [CURRENT_VERSION] * (n - 1) + [v]})
    if kind == "stale_version":
        v = draw(st.integers(-2**62, CURRENT_VERSION - MAX_STALENESS - 1))
        versions = [CURRENT_VERSION] * n
        versions[bad_row] = v
        return kind, _batch({**rows, "policy_version": versions})
    if kind == "null_list_type":
        rows["token_ids"] = [[None, "x"]] * n
        return kind, _batch(rows, {"token_ids": pa.list_(pa.string())})
    if kind == "duplicate_column":
        cols = dict(rows)
        arrays = [pa.array(v, type=FZ_TYPES[k]) for k, v in cols.items()] + [
            pa.array([2.0] * n, pa.float64())]
        return kind, pa.RecordBatch.from_arrays(arrays, names=list(cols) + ["reward"])
    if kind == "int_overflow":
        rows["next_agent_id"][bad_row] = draw(st.one_of(st.integers(2**31, 2**62),
                                                        st.integers(-2**62, -2**31 - 1)))
        return kind, _batch(rows, {"next_agent_id": pa.int64()})
    if kind == "status_wrong_type":
        return kind, _batch({**rows, "reward_status": [f"yes{i}" for i in range(n)]},
                            {"reward_status": pa.string()})
    if kind == "version_wrong_type":
        return kind, _batch({**rows, "policy_version": [f"v{i}" for i in range(n)]},
                            {"policy_version": pa.string()})
    # sample_id_wrong_type
    return kind, _batch({**rows, "sample_id": [[1]] * n}, {"sample_id": pa.list_(pa.int64())})


def put_call(descriptor: flight.FlightDescriptor, batch: pa.RecordBatch, kind: str) -> Call:
    def run(client: flight.FlightClient, options: flight.FlightCallOptions) -> Any:
        writer, meta = client.do_put(descriptor, batch.schema, options)
        answers = []
        try:
            writer.write_batch(batch)
            writer.done_writing()
            while (buf := meta.read()) is not None:
                answers.append(buf.to_pybytes())
        finally:
            writer.close()
        return answers
    return Call("do_put", f"{kind} {descriptor!r} schema={batch.schema} "
                          f"rows={batch.slice(0, 3).to_pylist()!r:.400}", run)


@st.composite
def bad_tensor_batches(draw) -> tuple[str, pa.RecordBatch]:
    """A batch for fz_other (obs: tensor<float32>) with one tensor whose shape and data
    disagree, or whose dimensions are negative, null or absurd (issue #29)."""
    n = draw(st.integers(1, 4))
    bad_row = draw(st.integers(0, n - 1))
    shapes: list[Any] = [[2, 2]] * n
    datas: list[Any] = [[1.0, 2.0, 3.0, 4.0]] * n
    element = pa.float32()
    kind = draw(st.sampled_from(["disagree", "negative", "absurd", "too_many", "null_dim",
                                 "null_shape", "bool_data", "overflow"]))
    if kind == "disagree":
        shapes[bad_row] = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(
            lambda sh: int(np.prod(sh)) != 4))
    elif kind == "negative":
        shapes[bad_row] = draw(st.sampled_from([[-2, -2], [-1, 4], [4, -1], [-4]]))
    elif kind == "absurd":
        shapes[bad_row], datas[bad_row] = [0, draw(st.integers(2**31, 2**62))], []
    elif kind == "too_many":
        shapes[bad_row], datas[bad_row] = [1] * draw(st.integers(33, 80)), [1.0]
    elif kind == "null_dim":
        shapes[bad_row] = [2, None]
    elif kind == "null_shape":
        shapes[bad_row] = None
    elif kind == "overflow":
        shapes[bad_row] = [2**31 - 1] * 4
    else:
        element, datas = pa.bool_(), [[True, False, True, False]] * n
    obs = pa.StructArray.from_arrays([pa.array(shapes, pa.list_(pa.int64())),
                                      pa.array(datas, pa.large_list(element))],
                                     names=["shape", "data"])
    return f"tensor_{kind}", pa.record_batch({
        "sample_id": pa.array(rh.sample_ids("fuzzt", 0, n)), "obs": obs,
        "done": pa.array([True] * n)})


bad_puts = st.one_of(
    bad_batches().map(lambda kb: put_call(flight.FlightDescriptor.for_path("fz"), kb[1], kb[0])),
    bad_tensor_batches().map(
        lambda kb: put_call(flight.FlightDescriptor.for_path("fz_other"), kb[1], kb[0])))


@st.composite
def bad_put_descriptors(draw) -> Call:
    _, batch = "valid", _batch(valid_rows("fuzzdesc", 2))
    descriptor = draw(st.one_of(
        unknown_table.map(lambda t: flight.FlightDescriptor.for_path(t)),
        st.just(flight.FlightDescriptor.for_path("fz", "extra")),
        st.just(flight.FlightDescriptor.for_path("fz_other")),   # the batch fits "fz" only
        st.binary(max_size=50).map(flight.FlightDescriptor.for_command),
        st.just(flight.FlightDescriptor.for_path())))
    return put_call(descriptor, batch, "descriptor")


# -- do_get tickets -----------------------------------------------------------------------------
WRITE_SQL = [
    "INSERT INTO fz (row_id, sample_id) VALUES (1, 'a_0_0')", "UPDATE fz SET consumed = true",
    "DELETE FROM fz", "DROP TABLE fz", "CREATE TABLE x (a INT)", "ALTER TABLE fz ADD COLUMN z INT",
    "ATTACH '/tmp/x.db' AS x", "COPY fz TO '/tmp/fz.csv'", "PRAGMA database_list",
    "SET memory_limit = '1GB'", "INSTALL httpfs", "LOAD httpfs", "CALL pragma_version()",
    "EXPORT DATABASE '/tmp/out'", "CHECKPOINT", "VACUUM", "SELECT 1; DROP TABLE fz",
    "SELECT * FROM read_csv('/etc/passwd')", "SELECT * FROM read_text('/etc/hostname')",
    "SELECT * FROM glob('/*')", "SELECT getenv('HOME')", "SELECT * FROM read_parquet('x.parquet')",
    "SELECT * FROM query('DELETE FROM fz')", "SELECT * FROM query_table('fz')",
    "SELECT current_setting('memory_limit')", "SELECT * FROM duckdb_settings()",
    "WITH x AS (DELETE FROM fz RETURNING *) SELECT * FROM x", "SELECT * FROM nosuchtable",
    "SELECT nosuchcolumn FROM fz", "SELEC 1", "", "   ", "SELECT * FROM sqlite_scan('x', 'y')",
    "BEGIN TRANSACTION", "ROLLBACK", "USE memory", "DETACH main", "SELECT 1 FROM fz WHERE (",
    # issue #29: what shows the server (settings, secret directories, the database's path)
    "SELECT * FROM pg_settings", "SELECT * FROM pg_catalog.pg_settings",
    "SELECT path FROM duckdb_databases", "SELECT * FROM duckdb_databases()",
    "SELECT * FROM pragma_database_list", "SELECT * FROM duckdb_secrets()",
    "SELECT install_path FROM duckdb_extensions()", "SELECT * FROM duckdb_logs",
    "SELECT getvariable('x')", "SELECT current_setting('secret_directory')",
    "SELECT * FROM fz WHERE sample_id IN (SELECT file FROM pragma_database_list)",
]


def ticket_call(raw: bytes) -> Call:
    def run(client: flight.FlightClient, options: flight.FlightCallOptions) -> Any:
        return client.do_get(flight.Ticket(raw), options).read_all()
    return Call("do_get", f"{raw[:300]!r}", run)


bad_tickets = st.one_of(
    st.binary(max_size=200).filter(_not_json_object).map(ticket_call),
    json_values.filter(lambda v: not isinstance(v, dict)).map(
        lambda v: ticket_call(json.dumps(v).encode())),
    st.sampled_from(WRITE_SQL).map(lambda q: ticket_call(json.dumps({"sql": q}).encode())),
    not_a_string.map(lambda q: ticket_call(json.dumps({"sql": q}).encode())),
    st.tuples(unknown_field, json_values).map(lambda kv: ticket_call(json.dumps(
        {"sql": "SELECT 1", kv[0]: kv[1]}).encode())),
    bad_seconds.filter(lambda t: not isinstance(t, (int, float)) or t <= 0 or t > 30).map(
        lambda t: ticket_call(json.dumps({"sql": "SELECT 1", "timeout": t}).encode())),
    st.one_of(st.text(max_size=5), st.integers(), st.dictionaries(st.text(max_size=3),
                                                                  st.integers(), min_size=1)).map(
        lambda p: ticket_call(json.dumps({"sql": "SELECT ?", "params": p}).encode())),
    st.just(ticket_call(json.dumps({"sql": "SELECT 1 -- " + "x" * (1 << 20)}).encode())),
    st.just(ticket_call(json.dumps({"sql": "SELECT " + "+".join(["1"] * 60000)}).encode())),
)


# -- do_exchange commands ----------------------------------------------------------------------
VALID_SUBSCRIBE = {"table": "fz", "micro_batch_size": 2, "global_batch_size": 4}
bad_subscribe = _poisoned(VALID_SUBSCRIBE, [
    _extra(), _drop("table"), _drop("micro_batch_size"), _drop("global_batch_size"),
    _set("table", unknown_table), _set("table", not_a_string),
    _set("micro_batch_size", st.one_of(st.integers(max_value=0), not_an_int)),
    _set("global_batch_size", st.one_of(st.integers(max_value=0), st.sampled_from([3, 5, 7]),
                                        not_an_int)),
    _set("max_in_flight", st.one_of(st.integers(max_value=0), not_an_int.filter(
        lambda v: v is not None))),
    _set("group_size", st.sampled_from([3, 0, -1, "x"])),
    _set("group_by", st.sampled_from(["reward", "sample_id", "", 7])),
    _set("where", malicious_predicates),
    _set("lease_seconds", st.one_of(st.floats(max_value=0, allow_nan=False),
                                    st.floats(min_value=86401), st.text(min_size=1, max_size=4),
                                    st.booleans())),
    _set("consumer", bad_consumer),
])


class InStreamError(Exception):
    """A subscription refused by a fatal error message on its stream (an error found at its
    first claim, e.g. a predicate naming an unknown column, arrives this way)."""

    def __init__(self, meta: dict) -> None:
        super().__init__(meta.get("message"))
        self.extra_info = json.dumps({"code": meta.get("code")}).encode()


def exchange_call(descriptor: flight.FlightDescriptor) -> Call:
    def run(client: flight.FlightClient, options: flight.FlightCallOptions) -> Any:
        writer, reader = client.do_exchange(descriptor, options)
        try:
            meta = json.loads(reader.read_chunk().app_metadata.to_pybytes())
            if meta.get("type") == "subscribed":
                meta = json.loads(reader.read_chunk().app_metadata.to_pybytes())
                if meta.get("type") == "error" and meta.get("fatal"):
                    raise InStreamError(meta)
            return meta
        finally:
            try:
                writer.done_writing()
            except (flight.FlightError, pa.ArrowException):
                pass
            writer.close()
    return Call("do_exchange", f"{descriptor!r:.400}", run)


bad_exchanges = st.one_of(
    bad_subscribe.map(lambda sub: exchange_call(flight.FlightDescriptor.for_command(
        json.dumps({"subscribe": sub}).encode()))),
    st.binary(max_size=100).filter(_not_json_object).map(
        lambda raw: exchange_call(flight.FlightDescriptor.for_command(raw))),
    json_values.filter(lambda v: not (isinstance(v, dict) and isinstance(v.get("subscribe"),
                                                                          dict))).map(
        lambda v: exchange_call(flight.FlightDescriptor.for_command(json.dumps(v).encode()))),
    st.just(exchange_call(flight.FlightDescriptor.for_path("fz"))),
)


# -- metadata calls -----------------------------------------------------------------------------
def info_call(descriptor: flight.FlightDescriptor, schema: bool) -> Call:
    def run(client: flight.FlightClient, options: flight.FlightCallOptions) -> Any:
        return (client.get_schema if schema else client.get_flight_info)(descriptor, options)
    return Call("get_schema" if schema else "get_flight_info", f"{descriptor!r:.300}", run)


bad_infos = st.tuples(st.one_of(
    unknown_table.map(lambda t: flight.FlightDescriptor.for_path(t)),
    st.just(flight.FlightDescriptor.for_path("fz", "x")),
    st.just(flight.FlightDescriptor.for_path()),
    st.binary(max_size=60).map(flight.FlightDescriptor.for_command)), st.booleans()).map(
    lambda ds: info_call(*ds))

ALL_BAD_CALLS = st.one_of(bad_action_bodies, bad_action_fields, unknown_actions(), bad_puts,
                          bad_put_descriptors(), bad_tickets, bad_exchanges, bad_infos)


# -- the tests ---------------------------------------------------------------------------------
@settings(max_examples=60, **FUZZ_SETTINGS)
@given(call=bad_action_bodies)
def test_malformed_action_bodies(target, call):
    check_call(target, call)


@settings(max_examples=120, **FUZZ_SETTINGS)
@given(call=bad_action_fields)
def test_action_fields_missing_extra_or_mistyped(target, call):
    check_call(target, call)


@settings(max_examples=25, **FUZZ_SETTINGS)
@given(call=unknown_actions())
def test_unknown_actions(target, call):
    check_call(target, call)


@settings(max_examples=100, **FUZZ_SETTINGS)
@given(call=st.one_of(bad_puts, bad_put_descriptors()))
def test_bad_put_batches(target, call):
    check_call(target, call)


@settings(max_examples=60, **FUZZ_SETTINGS)
@given(call=bad_tickets)
def test_bad_tickets(target, call):
    check_call(target, call)


@settings(max_examples=40, **FUZZ_SETTINGS)
@given(call=bad_exchanges)
def test_bad_exchange_commands(target, call):
    check_call(target, call)


@settings(max_examples=25, **FUZZ_SETTINGS)
@given(call=bad_infos)
def test_bad_descriptors(target, call):
    check_call(target, call)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(max_examples=12_000, **FUZZ_SETTINGS)
@given(call=ALL_BAD_CALLS)
def test_ten_thousand_bad_calls(target, call):
    check_call(target, call)


@pytest.mark.parametrize("sql", WRITE_SQL)
def test_every_write_or_file_access_through_the_query_path_is_refused(target, sql):
    """Deterministic coverage of the curated list (the fuzzer samples it): writes hidden in a
    WITH clause, DDL, ATTACH/COPY/PRAGMA/SET, file and environment functions, several statements."""
    check_call(target, ticket_call(json.dumps({"sql": sql}).encode()))


# -- long input: the echo is bounded, so the typed code still fits gRPC's metadata ----------------
LONG_NAME = "n" * 100_000


def _long_input_calls() -> dict[str, Call]:
    subscribe = {**VALID_SUBSCRIBE, "table": LONG_NAME}
    return {
        "table name (describe)": action_call("describe", {"table": LONG_NAME}),
        "table name (claim)": action_call("claim", {"table": LONG_NAME, "limit": 1}),
        "claim id (ack)": action_call("ack", {"claim_id": LONG_NAME}),
        "action name": action_call(LONG_NAME, {}),
        "put descriptor": put_call(flight.FlightDescriptor.for_path(LONG_NAME),
                                   _batch(valid_rows("long", 1)), "descriptor"),
        "info descriptor": info_call(flight.FlightDescriptor.for_path(LONG_NAME), False),
        "SQL table name": ticket_call(json.dumps(
            {"sql": f"SELECT * FROM {LONG_NAME[:99_000]}"}).encode()),
        "ticket field": ticket_call(json.dumps({"sql": "SELECT 1", LONG_NAME: 1}).encode()),
        "subscribe table": exchange_call(flight.FlightDescriptor.for_command(
            json.dumps({"subscribe": subscribe}).encode())),
    }


@pytest.mark.parametrize("case", list(_long_input_calls()))
def test_long_inputs_keep_their_typed_code(target, case):
    """A 100 KB name, id or descriptor: the error still carries its typed code (an unbounded
    echo lost it from ~7 KB and the whole error from 16 KB)."""
    code = check_call(target, _long_input_calls()[case])
    assert not code.startswith("("), f"{case}: the typed code was lost ({code})"


@pytest.mark.parametrize("verb", sorted(REFUSED_SQL_ACTIONS))
def test_refused_flight_sql_verbs_are_unimplemented(target, verb):
    """Transactions, savepoints, cancel, Substrait: UNIMPLEMENTED, never an internal error."""
    assert check_call(target, action_call(verb, None, raw=b"")) == "(ArrowNotImplementedError)"


# -- issue #29: each bad input found by outside testing, once, deterministically ------------------
def _issue_29_calls() -> dict[str, Call]:
    calls: dict[str, Call] = {}
    for label, body in [
        ("claim lease_seconds true", {"table": "fz", "limit": 1, "lease_seconds": True}),
        ("claim consumer 5", {"table": "fz", "limit": 1, "consumer": 5}),
        ("claim consumer with a NUL", {"table": "fz", "limit": 1, "consumer": "t\x00"}),
        ("claim_many lease_seconds false", {"requests": [{"table": "fz", "limit": 1}],
                                            "lease_seconds": False}),
        ("claim escaping predicate", {"table": "fz", "limit": 1,
                                      "where": "reward > 0) LIMIT (1"}),
        ("claim predicate reading the server", {"table": "fz", "limit": 1, "where":
                                                "(SELECT count(*) FROM pg_settings) > 0"}),
    ]:
        calls[label] = action_call("claim_many" if "requests" in body else "claim", body)
    for label, body in [
        ("table EXP beside exp", {"name": "FZ", "columns": {"a": "int64"}}),
        ("columns a and A", {"name": "brand_new", "columns": {"a": "int64", "A": "int64"}}),
        ("column Sample_ID", {"name": "brand_new", "columns": {"Sample_ID": "string"}}),
        ("column Row_Id", {"name": "brand_new", "columns": {"Row_Id": "int64"}}),
        ("column X_STATUS", {"name": "brand_new", "columns": {"x": "int64", "X_STATUS": "bool"}}),
    ]:
        calls[label] = action_call("create_table", body)
    rows = valid_rows("issue", 2)
    for label, column, values, typ in [
        ("int to bool", "done", [2, 0], pa.int64()),
        ("bool to float", "reward", [True, False], pa.bool_()),
        ("float to string", "response", [1.5, 2.5], pa.float64()),
        ("date to string", "response", [1, 2], pa.date32()),
        ("bool to int", "next_agent_id", [True, False], pa.bool_()),
    ]:
        table = "fz_other" if column == "done" else "fz"
        batch = (pa.record_batch({"sample_id": ["issue0_0_0", "issue1_0_0"],
                                  column: pa.array(values, typ)}) if table == "fz_other"
                 else _batch({**rows, column: values}, {column: typ}))
        calls[f"put {label}"] = put_call(flight.FlightDescriptor.for_path(table), batch, label)
    for label, sid in [("leading zeros", "issue0_00_0"), ("control character", "issue\x1b_0_0")]:
        calls[f"put sample id with {label}"] = put_call(
            flight.FlightDescriptor.for_path("fz"),
            _batch({**rows, "sample_id": [rows["sample_id"][0], sid]}), label)
    for label, shape, data in [("shape and data disagree", [2, 3], [1.0] * 5),
                               ("negative dimensions", [-2, -3], [1.0] * 6),
                               ("absurd dimension", [0, 2**40], [])]:
        obs = pa.StructArray.from_arrays([pa.array([shape], pa.list_(pa.int64())),
                                          pa.array([data], pa.large_list(pa.float32()))],
                                         names=["shape", "data"])
        calls[f"put tensor {label}"] = put_call(
            flight.FlightDescriptor.for_path("fz_other"),
            pa.record_batch({"sample_id": ["issuet_0_0"], "obs": obs}), label)
    calls["subscribe lease_seconds true"] = exchange_call(flight.FlightDescriptor.for_command(
        json.dumps({"subscribe": {**VALID_SUBSCRIBE, "lease_seconds": True}}).encode()))
    calls["subscribe consumer 5"] = exchange_call(flight.FlightDescriptor.for_command(
        json.dumps({"subscribe": {**VALID_SUBSCRIBE, "consumer": 5}}).encode()))
    return calls


@pytest.mark.parametrize("case", list(_issue_29_calls()))
def test_issue_29_inputs_are_refused_with_a_typed_code(target, case):
    """Each is the caller's mistake: a code a client does not retry (never storage_error)."""
    code = check_call(target, _issue_29_calls()[case])
    expected = ("already_exists" if "beside" in case else "query_refused" if "predicate" in case
                else "invalid_argument" if case.startswith(("claim", "subscribe", "column"))
                or "sample id" in case else "schema_mismatch")
    assert code == expected, f"{case}: {code}"


def test_valid_calls_still_work_after_the_fuzzing(target):
    """The fuzzed server still does its job (runs last in this module)."""
    assert target.snapshot() == target.baseline
    s = target.store
    s.put("fz", {"sample_id": ["after_0_0"], "reward": [1.0], "response": ["r"],
                 "token_ids": [[1]], "next_agent_id": [1]})
    claim = s.claim("fz", 100)
    assert claim.num_rows > 0
    s.ack(claim.claim_id)
    assert s.stats("fz")["fz"]["ready"] == 0
