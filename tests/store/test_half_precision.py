"""float16 and bfloat16 columns (scalar, list<T>, tensor<T>, by reference): values go in from
numpy, torch and Arrow, come back from a claim bit for bit (NaN payloads, infinities,
subnormals, -0; DuckDB holds their 16-bit patterns), are FLOAT in SQL, and a value of another dtype is refused naming the column,
its dtype and the expected one. Run against the embedded store (cached and uncached: claims
then read the values back from DuckDB) and a remote one through a real Flight server."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import store
from store.errors import InvalidArgument
from store.halves import BFLOAT16, widened

# Patterns worth keeping exact: signalling and quiet NaNs with payloads (both signs), the
# infinities, the smallest subnormals, -0, 1, the largest finite value.
BF16_BITS = np.array([0x7F81, 0x7FC0, 0xFF81, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x8000,
                      0x3F80, 0x7F7F, 0x0000], np.uint16)
F16_BITS = np.array([0x7C01, 0x7E00, 0xFC01, 0xFE01, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x8000,
                     0x3C00, 0x7BFF, 0x0000], np.uint16)
N = len(BF16_BITS)
COLUMNS = {"h": "float16", "b": "bfloat16", "lh": "list<float16>", "lb": "list<bfloat16>",
           "th": "tensor<float16>", "tb": "tensor<bfloat16>", "rb": "list<bfloat16>"}


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def _raw(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """The 16-bit patterns of a half-precision column's values (through lists and tensors)."""
    values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_struct(values.type):
        values = values.field("data")
    if pa.types.is_large_list(values.type):
        values = values.flatten()
    if isinstance(values, pa.ExtensionArray):
        values = values.storage
    return np.frombuffer(values.buffers()[1], np.uint16)[values.offset:values.offset + len(values)]


def _rows() -> dict:
    halves = F16_BITS.view(np.float16)
    bf = _bf16(BF16_BITS)
    return {"sample_id": [f"q{i}_0_0" for i in range(N)],
            "h": halves, "b": bf,                                   # whole columns
            "lh": [halves] * N, "lb": [bf] * N,                     # a list per row
            "th": [torch.from_numpy(halves.copy()).reshape(3, 4)] * N,
            "tb": [bf.reshape(4, 3)] * N, "rb": [bf] * N}


def test_types_are_spelled_and_held_as_documented(embedded_store):
    s = embedded_store
    s.create_table("t", COLUMNS, storage={"rb": "ref"})
    assert {c["name"]: c["type"] for c in s.describe("t")["columns"]} == COLUMNS
    schema = s.claim_schema("t")
    assert schema.field("h").type == pa.float16()
    assert schema.field("b").type == BFLOAT16
    assert schema.field("tb").type.field("data").type == pa.large_list(BFLOAT16)


def test_values_round_trip_bit_exact(any_store):
    any_store.create_table("t", COLUMNS, storage={"rb": "ref"})
    any_store.put("t", _rows())
    data = any_store.claim("t", N).data
    assert data.schema.field("b").type == BFLOAT16
    assert data.schema.field("lh").type == pa.large_list(pa.float16())
    order = np.array([int(s[1:].split("_")[0]) for s in data.column("sample_id").to_pylist()])
    assert _raw(data.column("h")).tolist() == F16_BITS[order].tolist()
    assert _raw(data.column("b")).tolist() == BF16_BITS[order].tolist()
    for name, bits in (("lh", F16_BITS), ("lb", BF16_BITS), ("th", F16_BITS),
                       ("tb", BF16_BITS), ("rb", BF16_BITS)):
        assert _raw(data.column(name)).tolist() == np.tile(bits, N).tolist(), name
    assert data.column("tb").combine_chunks().field("shape")[0].as_py() == [4, 3]


def test_python_sees_bfloat16_values_as_floats(any_store):
    """as_py / to_pylist give the numbers (not their 16-bit patterns), through lists and
    tensors (NaN stays NaN, null stays None); to_pandas gives them as Float32."""
    any_store.create_table("t", {"b": "bfloat16", "lb": "list<bfloat16>",
                                 "tb": "tensor<bfloat16>"}, required=[])
    bf = _bf16(np.array([0x3F80, 0xC0A0, 0x7FC1], np.uint16))      # 1.0, -5.0, a NaN
    any_store.put("t", [{"sample_id": "a_0_0", "b": 999424.0, "lb": bf, "tb": bf.reshape(3, 1)},
                        {"sample_id": "a_0_1", "b": None, "lb": None, "tb": None}])
    data = any_store.claim("t", 2).data
    rows = sorted(data.select(["sample_id", "b", "lb", "tb"]).to_pylist(),
                  key=lambda r: r["sample_id"])
    assert rows[0]["b"] == 999424.0 and isinstance(rows[0]["b"], float)
    assert rows[0]["lb"][:2] == [1.0, -5.0] and np.isnan(rows[0]["lb"][2])
    assert rows[0]["tb"]["shape"] == [3, 1] and rows[0]["tb"]["data"][:2] == [1.0, -5.0]
    assert rows[1] == {"sample_id": "a_0_1", "b": None, "lb": None, "tb": None}
    frame = data.to_pandas()
    assert str(frame["b"].dtype) == "Float32"
    assert sorted(frame["b"].dropna().tolist()) == [999424.0]
    as_floats = pa.table({"lb": widened(data.column("lb"))}).to_pandas()
    assert [list(v[:2]) for v in as_floats["lb"] if v is not None] == [[1.0, -5.0]]


def test_a_table_of_half_lists_and_tensors_answers_empty_reads(any_store):
    """Nothing ready: a claim answers no rows, with the claim schema, where it raised
    ArrowNotImplementedError ('extension'): pyarrow's ``Schema.empty_table`` cannot build a list
    of an extension type. Likewise SQL that selects no rows, and a subscription's next."""
    any_store.create_table("t", COLUMNS, storage={"rb": "ref"})
    claim = any_store.claim("t", 4)
    assert claim.data.num_rows == 0 and not claim.claim_id
    assert claim.data.schema.field("tb").type.field("data").type == pa.large_list(BFLOAT16)
    assert claim.data.schema.field("lb").type == pa.large_list(BFLOAT16)
    assert any_store.query("SELECT lb, tb, rb FROM t").num_rows == 0
    any_store.put("t", [{"sample_id": "a_0_0", "h": 1.0}])          # pending: the rest missing
    assert any_store.claim("t", 4, where="h > 0").data.num_rows == 0
    sub = any_store.subscribe("t", 1, 1)
    try:
        assert sub.next(timeout=0) is None
    finally:
        sub.close()


def test_arrow_input_updates_and_values_read_back_after_reopen(open_store, db_path):
    """Arrow halffloat and bfloat16 arrays go in as they are, a later write of one column
    updates the row; a reopened store's claims read the values from DuckDB and the blob files
    (not from the memory of the puts) and they are still exact."""
    s = open_store(db_path)
    s.create_table("t", {"h": "float16", "lb": "list<bfloat16>", "rb": "list<bfloat16>"},
                   storage={"rb": "ref"})
    bf = pa.ExtensionArray.from_storage(BFLOAT16, pa.array(np.tile(BF16_BITS, 2)))
    lb = pa.LargeListArray.from_arrays(pa.array([0, N, N, 2 * N], pa.int64()), bf,
                                       mask=pa.array([False, True, False]))
    s.put("t", pa.table({"sample_id": ["a_0_0", "b_0_0", "c_0_0"], "lb": lb, "rb": lb}))
    s.put("t", pa.table({"sample_id": ["a_0_0", "b_0_0", "c_0_0"],
                         "h": pa.array(F16_BITS[:3].view(np.float16))}))
    s.close()
    s = open_store(db_path)
    data = s.claim("t", 3, where="lb IS NOT NULL").data
    assert data.column("sample_id").to_pylist() == ["a_0_0", "c_0_0"]
    assert _raw(data.column("h")).tolist() == [F16_BITS[0], F16_BITS[2]]
    assert _raw(data.column("lb")).tolist() == np.tile(BF16_BITS, 2).tolist()
    assert _raw(data.column("rb")).tolist() == np.tile(BF16_BITS, 2).tolist()


def test_sql_sees_the_values_as_float(any_store):
    s = any_store
    s.create_table("t", COLUMNS, storage={"rb": "ref"})
    rows = _rows()
    s.put("t", rows)
    got = s.query("SELECT typeof(h) AS th, typeof(b) AS tb, typeof(lb) AS tlb, "
                  "count(*) FILTER (WHERE b > 0.5 AND b < 2) AS ones, "
                  "list_sum(rb[7:8]) AS tiny FROM t GROUP BY ALL").to_pylist()
    assert got == [{"th": "FLOAT", "tb": "FLOAT", "tlb": "FLOAT[]", "ones": 1,
                    "tiny": 0.0}]
    # every value exactly the float32 it widens to, by-reference ones included
    for sql in ("SELECT * FROM t", "SELECT sample_id, b, lb, rb, h FROM t WHERE turn = 0"):
        got = s.query(sql)
        order = [int(i[1:].split("_")[0]) for i in got.column("sample_id").to_pylist()]
        assert got.column("b").type == got.column("h").type == pa.float32()
        wide = got.column("b").to_numpy().view(np.uint32)
        assert wide.tolist() == (BF16_BITS[order].astype(np.uint32) << 16).tolist()
        assert got.column("h").to_numpy().astype(np.float16).view(np.uint16).tolist() == \
            F16_BITS[order].tolist()
        for name in ("lb", "rb"):
            flat = got.column(name).combine_chunks().flatten().to_numpy().view(np.uint32)
            assert flat.tolist() == np.tile(BF16_BITS.astype(np.uint32) << 16, N).tolist(), name
    # claim predicates see the values too
    picked = s.claim("t", N, where="b = 1 AND h = 1 AND list_contains(rb, 1)").data
    assert picked.column("sample_id").to_pylist() == [f"q{list(BF16_BITS).index(0x3F80)}_0_0"]


@pytest.mark.parametrize("column, value, dtype", [
    ("h", np.ones(2, np.float32), "float32"),
    ("b", torch.ones(2, dtype=torch.float16), "float16"),
    ("b", pa.array(np.ones(2, np.uint16)), "uint16"),
    ("lh", [np.ones(3, np.float64)] * 2, "float64"),
    ("lb", [torch.ones(3)] * 2, "float32"),
    ("tb", [torch.ones(2, 2, dtype=torch.float16)] * 2, "float16"),
    ("th", [_bf16(BF16_BITS[:4]).reshape(2, 2)] * 2, "bfloat16"),
], ids=["f32-to-f16", "torch-f16-to-bf16", "uint16-to-bf16", "list-f64-to-f16",
        "list-f32-to-bf16", "tensor-f16-to-bf16", "tensor-bf16-to-f16"])
def test_a_value_of_another_dtype_is_refused(any_store, column, value, dtype):
    any_store.create_table("t", COLUMNS)
    with pytest.raises(InvalidArgument) as err:
        any_store.put("t", {"sample_id": ["a_0_0", "b_0_0"], column: value})
    message = str(err.value)
    assert repr(column) in message and dtype in message and COLUMNS[column] in message, message
    assert any_store.query("SELECT count(*) FROM t").column(0).to_pylist() == [0]


def test_python_numbers_are_rounded_and_overflow_refused(embedded_store):
    s = embedded_store
    s.create_table("t", {"h": "float16", "lb": "list<bfloat16>"})
    s.put("t", [{"sample_id": "a_0_0", "h": 0.1, "lb": [1.00390625, 1.01171875, 3]}])
    data = s.claim("t", 1).data
    assert _raw(data.column("h")).tolist() == [np.float16(0.1).view(np.uint16)]
    assert _raw(data.column("lb")).tolist() == \
        torch.tensor([1.00390625, 1.01171875, 3]).bfloat16().view(torch.int16).tolist()
    with pytest.raises(InvalidArgument, match=r"'h'.*70000.*float16"):
        s.put("t", [{"sample_id": "b_0_0", "h": 70000.0}])
    with pytest.raises(InvalidArgument, match=r"'lb'.*true/false"):
        s.put("t", [{"sample_id": "b_0_0", "lb": [True]}])


def test_float16_values_widen_into_float32_columns(embedded_store):
    """The one conversion that keeps every value: float16 into float32/float64 columns."""
    s = embedded_store
    s.create_table("t", {"x": "float32", "y": "list<float64>"})
    s.put("t", {"sample_id": ["a_0_0"], "x": np.array([0.5], np.float16),
                "y": [np.array([1.5, -2], np.float16)]})
    assert s.claim("t", 1).data.select(["x", "y"]).to_pylist() == [{"x": 0.5, "y": [1.5, -2.0]}]
    with pytest.raises(InvalidArgument, match=r"'x'.*bfloat16.*float32"):
        s.put("t", {"sample_id": ["b_0_0"], "x": _bf16(BF16_BITS[:1])})


def test_create_table_refuses_unknown_half_spellings(embedded_store):
    with pytest.raises(InvalidArgument, match="float16, float32") as err:
        embedded_store.create_table("t", {"x": "list<float8>"})
    assert "bfloat16" in str(err.value)


@pytest.mark.parametrize("cache_limit", [None, 0], ids=["cached", "uncached"])
def test_auto_storage_mixes_inline_and_by_reference_values(open_store, db_path, cache_limit):
    """A column stored by size: long bfloat16 lists go to the blob store, short ones stay in
    DuckDB (Arrow has no if_else kernel for the extension type); both read back exactly, by a
    claim and by SQL."""
    options = {} if cache_limit is None else {"cache_limit": cache_limit}
    s = open_store(db_path, ref_threshold=64, **options)
    s.create_table("t", {"lb": "list<bfloat16>"})
    long, short = np.tile(BF16_BITS, 8), BF16_BITS[:3]   # 192 and 6 bytes
    s.put("t", {"sample_id": ["a_0_0", "b_0_0", "c_0_0"],
                "lb": [_bf16(long), _bf16(short), _bf16(long)]})
    stored = s.query("SELECT lb__ref IS NULL AS inline FROM t ORDER BY sample_id")
    assert stored.column(0).to_pylist() == [False, True, False]
    data = s.claim("t", 3).data.sort_by("sample_id")
    assert _raw(data.column("lb")).tolist() == [*long, *short, *long]
    for sql in ("SELECT * FROM t", "SELECT sample_id, lb FROM t"):  # (whole table; views)
        got = s.query(sql).sort_by("sample_id").column("lb").combine_chunks().flatten()
        assert (got.to_numpy().view(np.uint32) >> 16).tolist() == [*long, *short, *long], sql


CRASHING_WRITER = """
import sys
import numpy as np
import pyarrow as pa
import store
from store.halves import BFLOAT16, widened
s = store.connect(sys.argv[1])
s.create_table("t", {"h": "float16", "lb": "list<bfloat16>"})
bits = np.array(sys.argv[2].split(","), np.uint16)
lb = pa.ExtensionArray.from_storage(BFLOAT16, pa.array(bits))
for i in range(3):  # small puts: the put log's path
    s.put("t", {"sample_id": [f"q{i}_0_0"], "h": bits[i:i + 1].view(np.float16), "lb": [lb]})
print("PUT", flush=True)
sys.stdin.read()  # until killed
"""


def test_acknowledged_values_survive_a_kill_bit_for_bit(tmp_path):
    """Written, acknowledged, then SIGKILL: the reopened store (its put log replayed) has the
    same 16-bit patterns."""
    import os
    import signal
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = str(tmp_path / "x.duckdb")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, path, ",".join(map(str, F16_BITS))], cwd=root,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "PUT", child.stderr.read()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    s = store.connect(path)
    try:
        data = s.claim("t", 3).data.sort_by("sample_id")
        assert _raw(data.column("h")).tolist() == F16_BITS[:3].tolist()
        assert _raw(data.column("lb")).tolist() == np.tile(F16_BITS, 3).tolist()
    finally:
        s.close()
