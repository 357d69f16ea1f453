"""Loose validation, tightened (issue #29, item 6), through the real store (embedded and remote)
and a real Flight server: a write that would be stored as something other than what was sent
(a tensor whose shape and data disagree, 2 written to a bool column, a float to a string), a
sample id that would clash with another (leading zeros) or hold control characters, and claim
options of the wrong type are refused with invalid_argument (or schema_mismatch), naming the
value and what was expected; nothing is stored."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_fixtures import action, error_code, put_batches, running_server
from store.errors import InvalidArgument

COLUMNS = {"reward": "float64", "done": "bool", "text": "string", "n": "int32",
           "obs": "tensor<float32>"}


def _tensor(shape, values, element=pa.float32()):
    return pa.StructArray.from_arrays([pa.array([shape], pa.list_(pa.int64())),
                                       pa.array([values], pa.large_list(element))],
                                      names=["shape", "data"])


BAD_WRITES = [
    ("tensor shape and data disagree", {"obs": _tensor([2, 3], [1.0] * 5)}, "shape"),
    ("negative dimension", {"obs": _tensor([-1, -6], [1.0] * 6)}, "dimension"),
    ("absurd dimension", {"obs": _tensor([0, 2**40], [])}, "dimension"),
    ("tensor of bools", {"obs": _tensor([2], [True, False], pa.bool_())}, "true/false"),
    ("int to bool", {"done": pa.array([2], pa.int64())}, "true/false"),
    ("float to bool", {"done": pa.array([0.0])}, "true/false"),
    ("bool to float", {"reward": pa.array([True])}, "true/false"),
    ("float to string", {"text": pa.array([1.5])}, "text"),
    ("date to string", {"text": pa.array([1], pa.date32())}, "text"),
    ("text to int", {"n": pa.array(["7"])}, "numbers"),
]


@pytest.mark.parametrize("rows", [1, 20], ids=["small", "bulk"])
@pytest.mark.parametrize("label, columns, named", BAD_WRITES, ids=[b[0] for b in BAD_WRITES])
def test_a_write_that_would_change_is_refused(any_store, label, columns, named, rows):
    any_store.create_table("t", COLUMNS)
    data = {"sample_id": pa.array([f"q{i}_0_0" for i in range(rows)])}
    for name, one in columns.items():
        data[name] = pa.concat_arrays([one] * rows)
    with pytest.raises(InvalidArgument, match=named) as err:
        any_store.put("t", pa.table(data))
    assert "expected" in str(err.value) or "send" in str(err.value)
    assert any_store.query("SELECT count(*) AS n FROM t").column(0).to_pylist() == [0]


@pytest.mark.parametrize("value, column", [(True, "reward"), (1.5, "n"), (1.0, "done"),
                                           (7, "text"), (np.ones(3, bool), "obs")])
def test_python_values_follow_the_same_rules(any_store, value, column):
    any_store.create_table("t", COLUMNS)
    with pytest.raises(InvalidArgument, match=repr(column)):
        any_store.put("t", [{"sample_id": "q_0_0", column: value}])


@pytest.mark.parametrize("sid, named", [
    ("q1_00_0", "leading zero"), ("q1_0_01", "leading zero"), ("q\x00_0_0", "control"),
    ("q\x1b[2J_0_0", "control"), ("q\n_1_2", "control"), ("q_0_0\r", "control"),
])
@pytest.mark.parametrize("rows", [1, 20], ids=["small", "bulk"])
def test_sample_ids_that_would_clash_or_hold_control_characters(any_store, sid, named, rows):
    any_store.create_table("t", COLUMNS)
    ids = [sid] + [f"ok{i}_0_0" for i in range(rows - 1)]
    with pytest.raises(InvalidArgument, match=named) as err:
        any_store.put("t", {"sample_id": ids, "reward": [1.0] * rows})
    assert repr(sid)[1:-1][:20] in str(err.value)
    assert any_store.query("SELECT count(*) AS n FROM t").column(0).to_pylist() == [0]


def test_a_group_claim_never_delivers_one_trajectory_twice(any_store):
    """q1_00_0 beside q1_0_0 made two rows with the same (input, turn, trajectory, version),
    and a group claim of 2 delivered that one trajectory as a "complete group"."""
    any_store.create_table("t", {"reward": "float64"})
    any_store.put("t", [{"sample_id": "q1_0_0", "reward": 1.0}])
    with pytest.raises(InvalidArgument, match="'q1_0_0'"):  # the error names the canonical id
        any_store.put("t", [{"sample_id": "q1_00_0", "reward": 1.0}])
    assert not any_store.claim("t", 2, group_by="input_id", group_size=2)


@pytest.mark.parametrize("options, named", [
    ({"lease_seconds": True}, "lease_seconds"), ({"lease_seconds": False}, "lease_seconds"),
    ({"consumer": 5}, "consumer"), ({"consumer": ["t"]}, "consumer"),
    ({"consumer": "t\x00"}, "consumer"), ({"consumer": "x" * 1000}, "consumer"),
])
def test_claim_options_of_the_wrong_type_are_refused(any_store, options, named):
    any_store.create_table("t", {"reward": "float64"})
    any_store.put("t", [{"sample_id": "q_0_0", "reward": 1.0}])
    with pytest.raises(InvalidArgument, match=named):
        any_store.claim("t", 1, **options)
    with pytest.raises(InvalidArgument, match=named):
        any_store.subscribe("t", 1, 1, **options)
    assert any_store.stats("t")["t"]["ready"] == 1  # nothing leased


def test_the_wire_refuses_them_with_typed_codes(tmp_path):
    with running_server(tmp_path / "x.duckdb") as server:
        client = flight.connect(server.location)
        try:
            action(client, "create_table", {"name": "t", "columns": COLUMNS})
            action(client, "create_table", {"name": "u", "columns": {"reward": "float64"}})
            put_batches(client, "u", [pa.record_batch({"sample_id": ["q_0_0"],
                                                       "reward": [1.0]})])
            for body in ({"table": "u", "limit": 1, "lease_seconds": True},
                         {"table": "u", "limit": 1, "consumer": 7}):
                with pytest.raises(flight.FlightError) as err:
                    action(client, "claim", body)
                assert error_code(err.value) == "invalid_argument", body
            for label, columns, _ in BAD_WRITES:
                batch = pa.record_batch({"sample_id": pa.array(["q_0_0"]), **columns})
                with pytest.raises(flight.FlightError) as err:
                    put_batches(client, "t", [batch])
                assert error_code(err.value) in ("invalid_argument", "schema_mismatch"), label
            for sid in ("q1_00_0", "q\x07_0_0"):
                with pytest.raises(flight.FlightError) as err:
                    put_batches(client, "u", [pa.record_batch({"sample_id": [sid],
                                                               "reward": [1.0]})])
                assert error_code(err.value) == "invalid_argument", sid
        finally:
            client.close()
