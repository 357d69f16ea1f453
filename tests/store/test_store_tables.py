"""Tables: create, drop, describe, list; every column type round-trips; bad definitions refused."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from store import tensors
from store.errors import AlreadyExists, InvalidArgument, NotFound

SOLVER = {"prompt": "string", "response": "string", "reward": "float64",
          "token_ids": "list<int32>", "logprobs": "list<float32>", "next_agent_id": "int32"}


def test_create_describe_list_drop(any_store):
    s = any_store
    assert s.list_tables() == []
    d = s.create_table("solver", SOLVER, max_staleness=2, max_deliveries=3, lease_seconds=7.5,
                       storage={"response": "ref"}, required=["response", "reward"])
    assert d["name"] == "solver"
    assert [c["name"] for c in d["columns"]] == list(SOLVER)
    by_name = {c["name"]: c for c in d["columns"]}
    assert by_name["token_ids"]["type"] == "list<int32>"
    assert by_name["response"]["storage"] == "ref"
    assert by_name["reward"]["required"] and not by_name["prompt"]["required"]
    assert d["max_staleness"] == 2 and d["max_deliveries"] == 3 and d["lease_seconds"] == 7.5
    assert d["version"] == 0 and d["version_group"] == "solver"
    assert s.describe("solver") == d
    s.create_table("verifier", {"score": "float32"})
    assert s.list_tables() == ["solver", "verifier"]

    assert s.drop_table("solver") is True
    assert s.list_tables() == ["verifier"]
    with pytest.raises(NotFound, match="solver"):
        s.describe("solver")
    with pytest.raises(NotFound, match="solver"):
        s.put("solver", {"sample_id": ["q_0_0"], "reward": [1.0]})
    with pytest.raises(NotFound, match="solver"):
        s.drop_table("solver")


def test_drop_if_exists_and_recreate(any_store):
    s = any_store
    assert s.drop_table("ghost", if_exists=True) is False
    s.create_table("t", {"reward": "float64"})
    s.put("t", {"sample_id": ["a_0_0"], "reward": [1.0]})
    s.drop_table("t")
    s.create_table("t", {"reward": "float64", "extra": "int32"})
    # The re-created table starts empty with the new columns.
    assert s.query("SELECT count(*) AS n FROM t").column("n").to_pylist() == [0]
    assert [c["name"] for c in s.describe("t")["columns"]] == ["reward", "extra"]


def test_create_twice(any_store):
    s = any_store
    first = s.create_table("t", {"reward": "float64"})
    with pytest.raises(AlreadyExists, match="'t'"):
        s.create_table("t", {"reward": "float64"})
    # if_not_exists accepts the existing table and keeps its definition.
    again = s.create_table("t", {"other": "string"}, if_not_exists=True)
    assert again == first
    assert s.list_tables() == ["t"]


ALL_TYPES = {
    "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "f32": "float32", "f64": "float64", "flag": "bool", "text": "string", "raw": "binary",
    "ids": "list<int32>", "lps": "list<float32>", "t": "tensor<float32>",
}
VALUES = {
    "i8": [-128, 127], "i16": [-32768, 5], "i32": [-(2 ** 31), 6], "i64": [2 ** 62, -7],
    "u8": [255, 0], "u16": [65535, 1], "u32": [2 ** 32 - 1, 2], "u64": [2 ** 64 - 1, 3],
    "f32": [0.5, -1.25], "f64": [1e300, -2.5], "flag": [True, False], "text": ["x", "é ü ∑"],
    "raw": [b"\x00\x01\xff", b""], "ids": [[1, 2, 3], []], "lps": [[0.25, -0.5], [1.0]],
}
ARRAYS = [np.arange(6, dtype=np.float32).reshape(2, 3), np.full((1, 2, 2), 0.5, np.float32)]


def _check_row_values(table: pa.Table) -> None:
    rows = {r["sample_id"]: r for r in table.to_pylist()}
    for i, sid in enumerate(["a_0_0", "a_0_1"]):
        for col, values in VALUES.items():
            assert rows[sid][col] == values[i], (col, rows[sid][col], values[i])
    by_sid = dict(zip(table.column("sample_id").to_pylist(),
                      tensors.to_numpy(table.column("t"))))
    for sid, expected in zip(["a_0_0", "a_0_1"], ARRAYS):
        got = by_sid[sid]
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def test_all_types_round_trip(any_store):
    s = any_store
    s.create_table("all_types", ALL_TYPES)
    data = {"sample_id": ["a_0_0", "a_0_1"], **VALUES, "t": tensors.to_arrow(ARRAYS)}
    assert s.put("all_types", data)["rows"] == 2
    claim = s.claim("all_types", 10)
    assert claim.data.num_rows == 2
    _check_row_values(claim.data)
    s.ack(claim.claim_id)
    _check_row_values(s.query("SELECT * FROM all_types"))


def test_tensor_dtypes_and_shapes(any_store):
    s = any_store
    s.create_table("tens", {"f64": "tensor<float64>", "i32": "tensor<int32>"})
    f64 = [np.linspace(0, 1, 12).reshape(3, 4), np.array(7.0)]
    i32 = [np.arange(8, dtype=np.int32).reshape(2, 2, 2), np.zeros((0,), np.int32)]
    s.put("tens", {"sample_id": ["t_0_0", "t_0_1"], "f64": tensors.to_arrow(f64),
                   "i32": tensors.to_arrow(i32)})
    data = s.claim("tens", 2).data
    for col, expected, dtype in (("f64", f64, np.float64), ("i32", i32, np.int32)):
        got = tensors.to_numpy(data.column(col))
        for g, e in zip(got, expected):
            assert g.dtype == dtype and g.shape == e.shape
            np.testing.assert_array_equal(g, e)


def test_tensor_of_python_lists_that_does_not_fit_its_dtype_is_named():
    # (Python lists are converted to numpy once: the error names their dtype)
    with pytest.raises(ValueError, match="a tensor of float64 does not convert to int32"):
        tensors.to_arrow([[1.5, 2.0]], dtype="int32")


def test_pyarrow_types_are_accepted(any_store):
    s = any_store
    d = s.create_table("pa_types", {"a": pa.int16(), "b": pa.list_(pa.float32()),
                                    "c": pa.string()})
    assert [c["type"] for c in d["columns"]] == ["int16", "list<float32>", "string"]


@pytest.mark.parametrize("name", ["bad-name", "1starts_with_digit", "has space", "x" * 64, "",
                                  "_expstore_tables", "alembic_version", "semi;colon"])
def test_bad_table_name(any_store, name):
    with pytest.raises(InvalidArgument) as err:
        any_store.create_table(name, {"reward": "float64"})
    assert repr(name) in str(err.value)
    assert name not in any_store.list_tables()


@pytest.mark.parametrize("column", ["bad col", "sample_id", "policy_version", "reward_status",
                                    "a__b", "9lives", 'quote"d'])
def test_bad_column_name(any_store, column):
    with pytest.raises(InvalidArgument) as err:
        any_store.create_table("t", {column: "float64"})
    assert repr(column) in str(err.value)
    assert any_store.list_tables() == []


@pytest.mark.parametrize("spec", ["complex128", "list<>", "tensor<string>", "map<int32,int32>",
                                  "decimal(10,2)", "list<nope>"])
def test_bad_type(any_store, spec):
    with pytest.raises(InvalidArgument) as err:
        any_store.create_table("t", {"x": spec})
    # The message names the bad spelling (or its bad element type).
    inner = spec.split("<", 1)[-1].rstrip(">") or spec
    assert repr(spec) in str(err.value) or repr(inner) in str(err.value)
    assert any_store.list_tables() == []


def test_bad_storage(any_store):
    s = any_store
    with pytest.raises(InvalidArgument, match="'disk'"):
        s.create_table("t", {"x": "string"}, storage={"x": "disk"})
    with pytest.raises(InvalidArgument, match="'x'"):
        s.create_table("t", {"x": "int32"}, storage={"x": "ref"})  # scalars go by value
    with pytest.raises(InvalidArgument, match="'missing'"):
        s.create_table("t", {"x": "string"}, storage={"missing": "ref"})
    with pytest.raises(InvalidArgument, match="'missing'"):
        s.create_table("t", {"x": "string"}, required=["missing"])
    assert s.list_tables() == []


@pytest.mark.parametrize("kwargs, bad", [({"max_staleness": -1}, "-1"),
                                         ({"max_deliveries": 0}, "0"),
                                         ({"lease_seconds": 0}, "0"),
                                         ({"version_group": "bad group"}, "'bad group'")])
def test_bad_settings(any_store, kwargs, bad):
    with pytest.raises(InvalidArgument, match=bad):
        any_store.create_table("t", {"x": "float64"}, **kwargs)


def test_no_columns(any_store):
    with pytest.raises(InvalidArgument, match="'t'"):
        any_store.create_table("t", {})


def test_every_backend_implements_the_store_protocol(any_store):
    from store import Store
    assert isinstance(any_store, Store)
