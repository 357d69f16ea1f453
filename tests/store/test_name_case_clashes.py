"""Names that differ only in case are one name to SQL (issue #29, item 5): they are refused as
the caller's mistake (invalid_argument / already_exists, naming the clash), never a
storage_error that a client would retry for ever. Runs on the embedded and the remote store."""
from __future__ import annotations

import pyarrow.flight as flight
import pytest

from flight_fixtures import action, running_server
from store.errors import AlreadyExists, InvalidArgument


@pytest.mark.parametrize("columns, named", [
    ({"a": "int64", "A": "int64"}, "'a' and 'A'"),
    ({"reward": "float64", "REWARD": "float64"}, "'reward' and 'REWARD'"),
    ({"Sample_ID": "string"}, "sample_id"),
    ({"Row_Id": "int64"}, "row_id"),
    ({"POLICY_VERSION": "int64"}, "policy_version"),
    ({"x": "int64", "X_STATUS": "bool"}, "X_STATUS"),
    ({"Reward_Status": "bool"}, "Reward_Status"),
])
def test_columns_that_clash_in_case_are_invalid(any_store, columns, named):
    with pytest.raises(InvalidArgument, match=named) as err:
        any_store.create_table("t", columns)
    assert err.value.code == "invalid_argument"
    assert any_store.list_tables() == []


def test_a_table_that_clashes_in_case_already_exists(any_store):
    any_store.create_table("exp", {"reward": "float64"})
    for name in ("EXP", "Exp"):
        with pytest.raises(AlreadyExists, match=f"{name!r}.*'exp'"):
            any_store.create_table(name, {"reward": "float64"})
        with pytest.raises(AlreadyExists, match="'exp'"):
            any_store.create_table(name, {"reward": "float64"}, if_not_exists=True)
    assert any_store.list_tables() == ["exp"]
    any_store.put("exp", {"sample_id": ["q_0_0"], "reward": [1.0]})
    assert any_store.query("SELECT reward FROM exp").column(0).to_pylist() == [1.0]


def test_the_wire_carries_the_typed_codes(tmp_path):
    with running_server(tmp_path / "x.duckdb") as server:
        client = flight.connect(server.location)
        try:
            action(client, "create_table", {"name": "exp", "columns": {"a": "int64"}})
            with pytest.raises(flight.FlightError, match="already_exists"):
                action(client, "create_table", {"name": "EXP", "columns": {"a": "int64"}})
            with pytest.raises(flight.FlightError, match="invalid_argument"):
                action(client, "create_table", {"name": "t", "columns": {"a": "int64",
                                                                         "A": "int64"}})
        finally:
            client.close()
