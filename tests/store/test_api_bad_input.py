"""Bad input through the Python API, embedded and remote alike (``any_store``): each mistake a
new user makes is refused with a store error naming the value and what was expected (never a
bare TypeError, AttributeError or pyarrow error), and nothing stored changes."""
from __future__ import annotations

from typing import Any, Callable

import pytest

from store import ClaimRequest
from store.errors import InvalidArgument

ROWS = [{"sample_id": f"q{i}_0_0", "prompt": "p", "reward": 1.0} for i in range(4)]


def _stored(s: Any) -> list[dict]:
    return s.query("SELECT sample_id, prompt, reward, policy_version FROM t "
                   "ORDER BY sample_id").to_pylist()


CASES: dict[str, tuple[Callable[[Any], Any], list[str]]] = {
    "one row as a dict of scalars": (
        lambda s: s.put("t", {"sample_id": "q9_0_0", "prompt": "hello"}),
        ["'sample_id'", "'q9_0_0'", "list of values"]),
    "a string split into characters": (  # two rows, 'hi': stored 'h' and 'i' before
        lambda s: s.put("t", {"sample_id": ["q0_0_0", "q1_0_0"], "prompt": "hi"}),
        ["'prompt'", "'hi'", "list of values"]),
    "columns of different lengths": (
        lambda s: s.put("t", {"sample_id": ["q0_0_0", "q1_0_0"], "reward": [5.0]}),
        ["different lengths", "'sample_id': 2", "'reward': 1"]),
    "claim_many of tuples": (
        lambda s: s.claim_many([("t", 1)]), ["tuple", "('t', 1)", "ClaimRequest"]),
    "claim_many of one request": (
        lambda s: s.claim_many(ClaimRequest("t", 1)), ["ClaimRequest"]),
    "wait_version of a string": (
        lambda s: s.wait_version("t", "1", timeout=0.1), ["min_version '1'", "integer"]),
    "query parameters not a list": (
        lambda s: s.query("SELECT ?", 5), ["parameters 5", "list"]),
    "query timeout 0": (lambda s: s.query("SELECT 1", timeout=0), ["timeout 0", "> 0"]),
    "query timeout negative": (lambda s: s.query("SELECT 1", timeout=-1), ["timeout -1"]),
    "create_table of a list": (
        lambda s: s.create_table("c", ["a"]), ["'c'", "mapping", "list ['a']"]),
    "create_table of None": (lambda s: s.create_table("c", None), ["'c'", "NoneType None"]),
    "group_by without group_size": (
        lambda s: s.claim("t", 4, group_by="input_id"), ["'input_id' needs group_size"]),
    "group_size without group_by": (
        lambda s: s.claim("t", 4, group_size=2), ["group_size 2 needs group_by"]),
    "a tensor of timestamps": (  # (an element type the store has, but not for tensors)
        lambda s: s.create_table("c", {"x": "tensor<timestamp>"}),
        ["'timestamp' is not supported", "float32"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_is_a_store_error_naming_the_value(any_store, case):
    operation, named = CASES[case]
    any_store.create_table("t", {"prompt": "string", "reward": "float64"})
    any_store.put("t", ROWS)
    before = _stored(any_store)
    with pytest.raises(InvalidArgument) as raised:
        operation(any_store)
    for needle in named:
        assert needle in str(raised.value), (needle, str(raised.value))
    assert _stored(any_store) == before
    assert any_store.list_tables() == ["t"]
    assert any_store.stats("t")["t"]["ready"] == len(ROWS)


def test_data_frames_are_written_as_their_arrow_tables(any_store):
    pd = pytest.importorskip("pandas")
    any_store.create_table("t", {"prompt": "string", "reward": "float64"})
    frame = pd.DataFrame({"sample_id": ["q0_0_0", "q1_0_0"], "prompt": ["a", "b"],
                          "reward": [0.5, None]})
    assert any_store.put("t", frame)["rows"] == 2
    assert _stored(any_store) == [
        {"sample_id": "q0_0_0", "prompt": "a", "reward": 0.5, "policy_version": 0},
        {"sample_id": "q1_0_0", "prompt": "b", "reward": None, "policy_version": 0}]
    mixed = pd.DataFrame({"sample_id": ["q2_0_0", "q3_0_0"], "prompt": ["a", 7]})
    with pytest.raises(InvalidArgument, match="DataFrame to write does not convert"):
        any_store.put("t", mixed)
    assert len(_stored(any_store)) == 2


@pytest.mark.parametrize("empty", [[], {"sample_id": [], "prompt": []}],
                         ids=["empty list", "empty columns"])
def test_an_empty_write_says_so_on_both_backends(any_store, empty):
    any_store.create_table("t", {"prompt": "string", "reward": "float64"})
    with pytest.raises(InvalidArgument, match="the write holds no rows"):
        any_store.put("t", empty)


@pytest.mark.parametrize("rows", [2, 4000], ids=["small", "large"])
def test_a_put_past_its_timeout_says_what_became_of_it(any_store, rows):
    """Embedded: a TimeoutError without a message; remote: a QueryTimeout about a 'Deadline'."""
    any_store.create_table("t", {"prompt": "string", "reward": "float64"})
    with pytest.raises(TimeoutError) as raised:
        any_store.put("t", [{"sample_id": f"q{i}_0_0", "prompt": "p" * 100, "reward": 1.0}
                            for i in range(rows)], timeout=1e-9)
    assert "the put to 't' was not answered as durable within 1e-09 s" in str(raised.value)
    assert "sending it again is safe" in str(raised.value)


def test_settling_a_claim_of_a_dropped_table_names_the_drop(any_store):
    from store.errors import NotFound
    any_store.create_table("t", {"prompt": "string", "reward": "float64"})
    any_store.put("t", ROWS)
    claim = any_store.claim("t", 2)
    any_store.drop_table("t")
    with pytest.raises(NotFound, match="its table was dropped"):
        any_store.ack(claim.claim_id)
