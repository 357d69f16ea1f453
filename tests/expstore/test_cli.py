"""The ``expstore`` CLI through click's CliRunner, on real DuckDB files and a real Flight server.

Commands that read or change a store run against both backends (``--db`` embedded and ``--uri``
to an in-process server over a file in tmp_path); bad input must end with a one-line message and
a non-zero exit status, never a traceback.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import click
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

import store
from expstore.cli import cli
from flight_server.server import ExpstoreFlightServer

ROWS = 25


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    # EXPSTORE_* from the developer's shell must not leak into the tests.
    base = {"EXPSTORE_DB": None, "EXPSTORE_URI": None, "EXPSTORE_TOKEN": None}
    return CliRunner().invoke(cli, list(args), env={**base, **(env or {})})


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def fails(result: Result, code: int, *needles: str) -> Result:
    """A clean failure: the exit status, the message, and no traceback."""
    assert result.exit_code == code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)
    return result


def as_json(result: Result) -> Any:
    return json.loads(ok(result).stdout)


def seed(s: Any, table: str = "solver", rows: int = ROWS) -> None:
    s.create_table(table, {"prompt": "string", "tokens": "list<int32>", "reward": "float64"},
                   storage={"prompt": "ref"})
    s.put(table, [{"sample_id": f"q{i}_0_0", "prompt": f"prompt {i} " + "x" * 80,
                   "tokens": [i, i + 1], "reward": i / 2} for i in range(rows)])


# -- backends ------------------------------------------------------------------------------------
@dataclass
class Backend:
    """Where the CLI points (``args``) and how a test seeds the same store (``open``)."""

    name: str
    args: list[str]
    open: Callable[[], contextlib.AbstractContextManager]
    db: str

    def run(self, *args: str) -> Result:
        return invoke(*args, *self.args)


@contextlib.contextmanager
def _opened(address: str) -> Iterator[Any]:
    """The store at a path (embedded) or grpc:// address (remote), closed afterwards."""
    s = store.connect(address)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(params=["embedded", "remote"])
def backend(request, tmp_path) -> Iterator[Backend]:
    db = str(tmp_path / "x.duckdb")
    if request.param == "embedded":
        yield Backend("embedded", ["--db", db], lambda: _opened(db), db)
        return
    server = ExpstoreFlightServer(db, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield Backend("remote", ["--uri", server.location], lambda: _opened(server.location), db)
    finally:
        server.close()
        thread.join(timeout=30)


@pytest.fixture
def seeded(backend) -> Backend:
    with backend.open() as s:
        seed(s)
    return backend


# -- help ------------------------------------------------------------------------------------------
def _walk(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _walk(sub, path + (name,))


ALL_COMMANDS = list(_walk(cli))


def test_the_cli_has_every_command_of_the_design():
    names = {" ".join(p) for p in ALL_COMMANDS}
    for expected in ["serve", "migrate", "tables", "create-table", "describe", "query", "stats",
                     "version show", "version bump", "leases", "export", "gc", "demo", "bench"]:
        assert expected in names


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "expstore")
def test_every_command_has_help_with_an_example(path):
    command: click.Command = cli
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    assert command.help and "Example:" in command.help, path
    summary = command.help.strip().splitlines()[0]
    assert summary and len(summary) < 100
    result = ok(invoke(*path, "--help"))
    assert "Example:" in result.output


# -- choosing the store -----------------------------------------------------------------------------
def test_a_missing_database_is_an_error_and_is_not_created(tmp_path):
    db = tmp_path / "none.duckdb"
    fails(invoke("tables", "--db", str(db)), 1, "does not exist")
    assert not db.exists()


def test_db_from_the_environment(tmp_path):
    db = str(tmp_path / "env.duckdb")
    with _opened(db) as s:
        seed(s)
    assert json.loads(ok(invoke("tables", "--json", env={"EXPSTORE_DB": db})).stdout) == \
        ["solver"]


def test_db_and_uri_together_are_refused(tmp_path):
    fails(invoke("tables", "--db", str(tmp_path / "x.duckdb"), "--uri", "grpc://127.0.0.1:1"),
          2, "not both")


def test_explicit_db_beats_uri_from_the_environment(tmp_path):
    db = str(tmp_path / "x.duckdb")
    with _opened(db) as s:
        seed(s)
    result = invoke("tables", "--db", db, env={"EXPSTORE_URI": "grpc://127.0.0.1:1"})
    assert ok(result).stdout.split() == ["solver"]


def test_a_refused_connection_fails_at_once_naming_the_address():
    result = fails(invoke("tables", "--uri", "grpc://127.0.0.1:1"), 1,
                   "no expstore server listens at 127.0.0.1:1 (connection refused)",
                   "expstore serve --port 1")
    assert len(result.output.strip().splitlines()) == 1


def test_an_unknown_server_host_is_a_clear_error():
    fails(invoke("tables", "--uri", "grpc://no-such-host.invalid:8815"), 1,
          "'no-such-host.invalid'", "unknown")


def test_an_unknown_uri_scheme_is_a_clear_error():
    fails(invoke("tables", "--uri", "http://127.0.0.1:1"), 1, "unknown scheme")


def test_a_uri_without_a_scheme_is_refused_and_creates_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fails(invoke("tables", "--uri", "127.0.0.1:8815"), 1, "'127.0.0.1:8815'",
          "grpc://127.0.0.1:8815")
    fails(invoke("tables", env={"EXPSTORE_URI": "localhost:8815"}), 1, "'localhost:8815'")
    assert os.listdir(tmp_path) == []


# -- create-table / tables / describe ---------------------------------------------------------------
def test_a_negative_max_staleness_is_bad_usage_and_the_help_does_not_offer_it(tmp_path):
    db = str(tmp_path / "x.duckdb")
    fails(invoke("create-table", "t", "a:int64", "--max-staleness", "-1", "--db", db), 2,
          "--max-staleness", "-1")
    assert not os.path.exists(db)
    assert "-1" not in ok(invoke("create-table", "--help")).output


def test_create_table_and_describe(backend):
    out = as_json(backend.run(
        "create-table", "solver", "prompt:string", "response:string", "tokens:list<int32>",
        "reward:float64", "--storage", "response=ref", "--required", "prompt",
        "--max-staleness", "2", "--version-group", "grp", "--max-deliveries", "3",
        "--lease-seconds", "30", "--json"))
    assert out["name"] == "solver" and out["version_group"] == "grp"
    assert out["max_staleness"] == 2 and out["max_deliveries"] == 3
    cols = {c["name"]: c for c in out["columns"]}
    assert cols["tokens"]["type"] == "list<int32>"
    assert cols["response"]["storage"] == "ref"
    assert cols["prompt"]["required"] and not cols["reward"]["required"]

    assert as_json(backend.run("tables", "--json")) == ["solver"]
    assert ok(backend.run("tables")).stdout.split() == ["solver"]
    assert as_json(backend.run("describe", "solver", "--json"))["columns"] == out["columns"]
    text = ok(backend.run("describe", "solver")).stdout
    assert "version_group" in text and "list<int32>" in text and "response" in text


def test_create_table_twice(backend):
    ok(backend.run("create-table", "t", "a:int64"))
    result = fails(backend.run("create-table", "t", "a:int64"), 1, "already exists",
                   "add --if-not-exists")
    assert "if_not_exists=True" not in result.output  # the library's spelling, not the CLI's
    ok(backend.run("create-table", "t", "a:int64", "--if-not-exists"))


@pytest.mark.parametrize("args, code, message", [
    (["t", "a:floaty"], 1, "unknown column type 'floaty'"),
    (["t", "a"], 2, "is not NAME:TYPE"),
    (["t", "a:int64", "a:int64"], 2, "given twice"),
    (["t"], 2, "Missing argument"),
    (["bad name", "a:int64"], 1, "bad name"),
    (["t", "a:int64", "--storage", "a"], 2, "COLUMN=MODE"),
    (["t", "a:int64", "--required", "b"], 1, "'b'"),
], ids=["bad-type", "no-colon", "twice", "no-columns", "bad-name", "bad-storage", "bad-required"])
def test_create_table_bad_input(tmp_path, args, code, message):
    fails(invoke("create-table", *args, "--db", str(tmp_path / "x.duckdb")), code, message)


def test_describe_an_unknown_table(seeded):
    fails(seeded.run("describe", "nope"), 1, "'nope' does not exist", "solver")


def test_tables_when_there_are_none(tmp_path):
    db = str(tmp_path / "x.duckdb")
    ok(invoke("migrate", "--db", db))
    assert as_json(invoke("tables", "--db", db, "--json")) == []


# -- query ---------------------------------------------------------------------------------------
def test_query_json(seeded):
    rows = as_json(seeded.run("query", "SELECT sample_id, reward, tokens FROM solver "
                                       "ORDER BY reward LIMIT 3", "--json"))
    assert rows == [{"sample_id": f"q{i}_0_0", "reward": i / 2, "tokens": [i, i + 1]}
                    for i in range(3)]
    assert as_json(seeded.run("query", "SELECT count(*) AS n FROM solver",
                              "--format", "json")) == [{"n": ROWS}]


def test_query_params(seeded):
    rows = as_json(seeded.run("query", "SELECT sample_id FROM solver WHERE reward >= ? AND "
                                       "sample_id LIKE ? ORDER BY reward",
                              "-p", "11.5", "-p", "q2%", "--json"))
    assert rows == [{"sample_id": "q23_0_0"}, {"sample_id": "q24_0_0"}]


def test_query_table_format_is_aligned_and_cut(seeded):
    out = ok(seeded.run("query", "SELECT sample_id, prompt, prompt__ref, reward FROM solver "
                                 "ORDER BY reward LIMIT 2", "--max-width", "20")).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["sample_id", "prompt", "reward"]
    assert set(lines[1]) <= {"-", " "}
    assert "prompt 0 xxxxxxxxxx…" in lines[2]  # 20 characters, cut with an ellipsis
    assert lines[2].index("prompt 0") == lines[0].index("prompt")  # aligned
    assert lines[-1] == "(2 rows)"


WIDE = [chr(c) for c in range(ord("a"), ord("z") + 1)]


@pytest.fixture
def wide(tmp_path) -> str:
    """A table of 26 string columns, two rows of 12-character values."""
    db = str(tmp_path / "wide.duckdb")
    with _opened(db) as s:
        s.create_table("wide", {c: "string" for c in WIDE})
        s.put("wide", {"sample_id": ["q0_0_0", "q1_0_0"],
                       **{c: [c * 12, f"value of {c}"] for c in WIDE}})
    return db


def test_a_result_too_wide_for_the_terminal_is_shown_one_row_per_block(wide):
    out = ok(invoke("query", f"SELECT {', '.join(WIDE)} FROM wide ORDER BY a", "--db", wide,
                    env={"COLUMNS": "120"})).stdout
    lines = out.splitlines()
    assert lines[0].startswith("-[ row 1 ]") and "-[ row 2 ]" in out
    assert "a  aaaaaaaaaaaa" in lines  # whole values, not 4 characters
    assert "z  value of z" in lines
    assert lines[-1] == "(2 rows)"
    cut = ok(invoke("query", f"SELECT {', '.join(WIDE)} FROM wide ORDER BY a", "--db", wide,
                    "--max-width", "8", env={"COLUMNS": "120"})).stdout.splitlines()
    assert "a  aaaaaaa…" in cut  # --max-width is honoured there too


def test_a_result_that_fits_stays_a_table_and_vertical_can_be_asked_for(wide):
    sql = "SELECT a, b FROM wide ORDER BY a"
    table = ok(invoke("query", sql, "--db", wide, env={"COLUMNS": "120"})).stdout.splitlines()
    assert table[0].split() == ["a", "b"] and "aaaaaaaaaaaa" in table[2]
    records = ok(invoke("query", sql, "--db", wide, "--vertical")).stdout.splitlines()
    assert records[0].startswith("-[ row 1 ]") and "b  bbbbbbbbbbbb" in records


def test_query_output_format_follows_the_file_name(seeded, tmp_path):
    ok(seeded.run("query", "SELECT sample_id FROM solver", "-o", str(tmp_path / "o.csv")))
    assert (tmp_path / "o.csv").read_text().splitlines()[0] == "sample_id"
    ok(seeded.run("query", "SELECT sample_id FROM solver", "-o", str(tmp_path / "o.parquet")))
    assert pq.read_table(tmp_path / "o.parquet").num_rows == ROWS
    ok(seeded.run("query", "SELECT sample_id FROM solver", "-o", str(tmp_path / "o.json")))
    assert len(json.loads((tmp_path / "o.json").read_text())) == ROWS


def test_query_csv(seeded, tmp_path):
    out = ok(seeded.run("query", "SELECT sample_id, tokens, reward FROM solver ORDER BY reward",
                        "--format", "csv")).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == ROWS
    assert rows[3] == {"sample_id": "q3_0_0", "tokens": "[3, 4]", "reward": "1.5"}
    target = tmp_path / "out.csv"
    ok(seeded.run("query", "SELECT sample_id FROM solver", "--format", "csv", "-o", str(target)))
    assert len(target.read_text().splitlines()) == ROWS + 1


def test_query_parquet(seeded, tmp_path):
    target = tmp_path / "out.parquet"
    ok(seeded.run("query", "SELECT sample_id, prompt, prompt__ref, tokens FROM solver",
                  "--format", "parquet", "--output", str(target)))
    table = pq.read_table(target)
    assert table.num_rows == ROWS
    assert table.column_names == ["sample_id", "prompt", "tokens"]  # reference resolved
    assert all(p.startswith("prompt ") for p in table.column("prompt").to_pylist())


@pytest.mark.parametrize("args, code, message", [
    (["DELETE FROM solver"], 1, "read-only"),
    (["SELECT * FROM nope"], 1, "nope"),
    (["SELECT FROM WHERE"], 1, "syntax error"),
    (["SELECT 1", "--format", "parquet"], 2, "needs --output"),
    (["SELECT 1", "--format", "csv", "--json"], 2, "exclude each other"),
    (["SELECT 1", "--format", "xml"], 2, "'xml' is not one of"),
    (["SELECT 1", "--timeout", "0"], 2, "--timeout"),
], ids=["write", "unknown-table", "syntax", "parquet-no-output", "json-and-csv", "bad-format",
        "bad-timeout"])
def test_query_bad_input(seeded, args, code, message):
    fails(seeded.run("query", *args), code, message)


def test_query_timeout_is_passed_on(seeded):
    assert as_json(seeded.run("query", "SELECT 1 AS one", "--timeout", "5", "--json")) == \
        [{"one": 1}]


# -- stats / leases / versions -------------------------------------------------------------------
def test_stats(seeded):
    with seeded.open() as s:
        claim = s.claim("solver", 4, lease_seconds=600)
        s.ack(claim.claim_id)
        s.claim("solver", 3, lease_seconds=600)
    data = as_json(seeded.run("stats", "--json"))
    assert data["solver"]["rows"] == ROWS and data["solver"]["consumed"] == 4
    one = as_json(seeded.run("stats", "solver", "--json"))
    assert one["solver"]["rows_per_version"] == {"0": ROWS}
    text = ok(seeded.run("stats", "solver")).stdout
    assert text.splitlines()[0].split()[:4] == ["table", "group", "version", "rows"]
    assert "rows per policy version: v0: 25" in text
    fails(seeded.run("stats", "nope"), 1, "'nope' does not exist")


def test_stats_of_a_long_run_fits_the_terminal(seeded):
    """Days of training make thousands of versions: the text view names the newest ones and
    sums up the others (--json keeps each), rather than printing one line per version."""
    with seeded.open() as s:
        for v in range(40):
            s.bump_version("solver")
            s.put("solver", [{"sample_id": f"v{v}_0_0", "prompt": "p", "tokens": [1],
                              "reward": 0.0}])
    text = ok(seeded.run("stats", "solver")).stdout
    assert max(len(line) for line in text.splitlines()) <= 120, text   # (no terminal: 120)
    assert "v40: 1" in text and "v31: 1" in text and "v30: 1" not in text
    assert "v0–v30: 55 rows in 31 versions" in text        # 25 at v0, one each at v1 … v30
    per_version = as_json(seeded.run("stats", "solver", "--json"))["solver"]["rows_per_version"]
    assert len(per_version) == 41


def test_stats_watch_is_bounded_by_count(seeded):
    lines = ok(seeded.run("stats", "--watch", "--count", "3", "--interval", "0.05",
                          "--json")).stdout.splitlines()
    assert len(lines) == 3
    assert all(json.loads(line)["solver"]["rows"] == ROWS for line in lines)
    text = ok(seeded.run("stats", "--watch", "--count", "2", "--interval", "0.05")).stdout
    assert text.count("Ctrl-C to stop") == 2


def test_leases(seeded):
    with seeded.open() as s:
        claim = s.claim("solver", 5, consumer="trainer-7", lease_seconds=600)
    if seeded.name == "embedded":
        # Leases live in the process holding the store: the one above closed it, and opening
        # the file again voids every lease (store/recovery.py).
        assert as_json(seeded.run("leases", "--json")) == []
        assert "no active leases" in ok(seeded.run("leases")).output
        return
    current = as_json(seeded.run("leases", "--json"))
    assert [(c["claim_id"], c["consumer"], c["rows"]) for c in current] == \
        [(claim.claim_id, "trainer-7", {"solver": 5})]
    assert as_json(seeded.run("leases", "solver", "--json"))[0]["claim_id"] == claim.claim_id
    text = ok(seeded.run("leases")).stdout
    assert claim.claim_id in text and "trainer-7" in text and "solver:5" in text


def test_leases_when_there_are_none(seeded):
    assert as_json(seeded.run("leases", "--json")) == []
    assert "no active leases" in ok(seeded.run("leases")).output


def test_version_show_and_bump(seeded):
    assert as_json(seeded.run("version", "show", "solver", "--json")) == \
        {"table": "solver", "version_group": "solver", "version": 0, "weights_uri": None}
    assert "solver: version 1" in ok(seeded.run("version", "bump", "solver")).stdout
    out = as_json(seeded.run("version", "bump", "solver", "--expected", "1",
                             "--weights-uri", "s3://ckpt/2", "--json"))
    assert out == {"table": "solver", "version": 2, "weights_uri": "s3://ckpt/2"}
    fails(seeded.run("version", "bump", "solver", "--expected", "1"), 1, "expected 1")
    shown = ok(seeded.run("version", "show", "solver")).stdout
    assert "s3://ckpt/2" in shown and "2" in shown
    fails(seeded.run("version", "show", "nope"), 1, "'nope' does not exist")
    fails(seeded.run("version", "bump", "solver", "--expected", "x"), 2, "'x' is not a valid")


def test_version_barrier_shows_and_sets_the_groups_barrier(seeded):
    state = as_json(seeded.run("version", "barrier", "solver", "--timeout", "90", "--json"))
    assert state["members"] == ["solver"] and state["timeout"] == 90
    assert state["arrived"] == [] and state["failed"] is None
    assert "90" in ok(seeded.run("version", "barrier", "solver")).stdout
    fails(seeded.run("version", "barrier", "solver", "--timeout", "0"), 1, "barrier timeout 0")


# -- export / gc / migrate ------------------------------------------------------------------------
def test_export_table_parquet_in_chunks(seeded, tmp_path):
    target = tmp_path / "solver.parquet"
    out = as_json(seeded.run("export", "solver", "-o", str(target), "--chunk-rows", "7",
                             "--json"))
    assert out == {"rows": ROWS, "output": str(target), "format": "parquet", "source": "solver"}
    table = pq.read_table(target)
    assert table.num_rows == ROWS
    assert table.column("row_id").to_pylist() == sorted(table.column("row_id").to_pylist())
    assert len(set(table.column("sample_id").to_pylist())) == ROWS
    assert "prompt__ref" not in table.column_names
    assert all(p.startswith("prompt ") for p in table.column("prompt").to_pylist())
    assert not os.path.exists(f"{target}.partial")


def test_export_table_jsonl(seeded, tmp_path):
    target = tmp_path / "solver.jsonl"
    text = ok(seeded.run("export", "solver", "--output", str(target))).stdout
    assert f"exported {ROWS} rows" in text and "(jsonl)" in text
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(rows) == ROWS
    by_id = {r["sample_id"]: r for r in rows}
    assert by_id["q3_0_0"]["tokens"] == [3, 4] and by_id["q3_0_0"]["reward"] == 1.5
    assert isinstance(by_id["q3_0_0"]["created_at"], str)


def test_export_sql(seeded, tmp_path):
    target = tmp_path / "good.data"
    out = as_json(seeded.run("export", "--sql", "SELECT sample_id, reward FROM solver WHERE "
                             "reward >= 10", "-o", str(target), "--format", "jsonl",
                             "--chunk-rows", "2", "--json"))
    assert out["rows"] == 5 and out["format"] == "jsonl"
    assert sorted(json.loads(line)["reward"] for line in target.read_text().splitlines()) == \
        [10.0, 10.5, 11.0, 11.5, 12.0]
    parquet = tmp_path / "good.parquet"
    ok(seeded.run("export", "--sql", "SELECT sample_id FROM solver", "-o", str(parquet)))
    assert pq.read_table(parquet).num_rows == ROWS


def test_export_an_empty_table(backend, tmp_path):
    ok(backend.run("create-table", "empty", "a:int64"))
    target = tmp_path / "empty.parquet"
    ok(backend.run("export", "empty", "-o", str(target)))
    table = pq.read_table(target)
    assert table.num_rows == 0 and "a" in table.column_names


@pytest.mark.parametrize("args, code, message", [
    (["nope", "-o", "{tmp}/n.parquet"], 1, "'nope' does not exist"),
    (["-o", "{tmp}/n.parquet"], 2, "TABLE or --sql"),
    (["solver", "--sql", "SELECT 1", "-o", "{tmp}/n.parquet"], 2, "TABLE or --sql"),
    (["solver"], 2, "--output"),
    (["--sql", "DROP TABLE solver", "-o", "{tmp}/n.parquet"], 1, "read-only"),
    (["solver", "-o", "{tmp}/no/such/dir/n.parquet"], 1, "n.parquet.partial"),
    (["solver", "-o", "{tmp}/n.csv"], 1, "cannot tell the export format"),
    (["solver", "-o", "{tmp}/n"], 1, "give --format parquet|jsonl"),
], ids=["unknown-table", "no-source", "two-sources", "no-output", "write-sql", "bad-dir",
        "csv-name", "no-suffix"])
def test_export_bad_input(seeded, tmp_path, args, code, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    fails(seeded.run("export", *args), code, message)
    assert not (tmp_path / "n.parquet").exists()
    assert not (tmp_path / "n.parquet.partial").exists()
    assert not (tmp_path / "n.csv").exists() and not (tmp_path / "n").exists()


def test_export_format_given_beats_the_file_name(seeded, tmp_path):
    ok(seeded.run("export", "solver", "-o", str(tmp_path / "n.data"), "--format", "parquet"))
    assert pq.read_table(tmp_path / "n.data").num_rows == ROWS


def test_gc(seeded):
    out = as_json(seeded.run("gc", "--json"))
    assert set(out) >= {"segments_removed", "bytes_freed"}
    assert "segments_removed" in ok(seeded.run("gc")).stdout


def test_gc_drop_deletes_consumed_rows_out_of_reach_on_both_backends(seeded):
    with seeded.open() as s:
        s.ack(s.claim("solver", 10).claim_id)
    assert as_json(seeded.run("gc", "--drop", "consumed", "--json"))["rows_dropped"] == 0
    ok(seeded.run("version", "bump", "solver"))     # version 0 is out of reach (max_staleness 0)
    out = as_json(seeded.run("gc", "--drop", "consumed", "--drop", "stale", "--json"))
    assert out["rows_dropped"] == 10 + (ROWS - 10 - 1)  # all but the newest row
    assert "rows_dropped" in ok(seeded.run("gc", "--drop", "consumed")).stdout
    stats = as_json(seeded.run("stats", "solver", "--json"))["solver"]
    assert stats["rows"] == 1 and stats["consumed"] == 0
    fails(seeded.run("gc", "--drop", "ready"), 2, "'ready'")
    fails(seeded.run("gc", "--keep-versions", "3"), 2, "give --drop")
    fails(seeded.run("gc", "--drop", "consumed", "--keep-versions", "-1"), 2, "-1")
    assert as_json(seeded.run("gc", "--drop", "consumed", "--keep-versions", "3", "--json")
                   )["rows_dropped"] == 0


def test_requeue_brings_dead_rows_back_on_both_backends(seeded):
    with seeded.open() as s:
        for _ in range(5):                # max_deliveries 5: the fifth nack dead-letters them
            s.nack(s.claim("solver", 3).claim_id)
    assert as_json(seeded.run("stats", "solver", "--json"))["solver"]["dead"] == 3
    out = as_json(seeded.run("requeue", "solver", "--where", "reward < 1", "--json"))
    assert out == {"table": "solver", "requeued": 2, "skipped_stale": 0, "skipped_lost": 0}
    stats = as_json(seeded.run("stats", "solver", "--json"))["solver"]
    assert (stats["dead"], stats["ready"]) == (1, ROWS - 1)
    ok(seeded.run("version", "bump", "solver"))     # the last dead row is below the bound now
    assert ok(seeded.run("requeue", "solver")).stdout.strip() == \
        "requeued 0 dead rows of solver; left dead: 1 below the staleness bound"
    fails(seeded.run("requeue", "solver", "--where", "no_such_column > 1"), 1, "no_such_column")
    fails(seeded.run("requeue", "missing"), 1, "'missing'")


def test_migrate(tmp_path):
    import migrations

    db = str(tmp_path / "m.duckdb")
    first = as_json(invoke("migrate", "--db", db, "--json"))
    assert first == {"db": db, "from": None, "to": migrations.head(), "head": migrations.head()}
    again = ok(invoke("migrate", "--db", db)).stdout
    assert "already there" in again
    with _opened(db) as s:  # the migrated catalog opens as a store
        assert s.list_tables() == []


def _one_clean_line(result: Result) -> str:
    """The message of a failure told in one line, in the CLI's words, not the database's."""
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    for internal in ("_duckdb", "sqlalche", "Background on this error", "See also http"):
        assert internal not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_migrate_on_an_unwritable_path_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("x")
    db = str(tmp_path / "file" / "m.duckdb") if where == "under-a-file" else "/proc/m.duckdb"
    line = _one_clean_line(fails(invoke("migrate", "--db", db), 1, "cannot be opened"))
    assert repr(db) in line and "check that its directory exists" in line


def test_a_file_that_is_no_database_is_one_line(tmp_path):
    db = tmp_path / "text.duckdb"
    db.write_text("hello\n" * 100)
    for command in (["migrate"], ["tables"]):
        _one_clean_line(fails(invoke(*command, "--db", str(db)), 1, "is not a DuckDB database"))


def test_migrate_to_an_unknown_revision(tmp_path):
    fails(invoke("migrate", "--db", str(tmp_path / "m.duckdb"), "--revision", "nosuch"), 1,
          "'nosuch'")


# -- entry points owned by other packages ---------------------------------------------------------
def test_bench_passes_its_arguments_on():
    result = ok(invoke("bench", "--list"))
    assert "flight_raw" in result.output


def test_every_command_is_documented_in_docs_cli_md():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    headings = [line for line in doc.splitlines() if line.startswith("## ")]
    for path in ALL_COMMANDS[1:]:
        name = " ".join(path)
        assert any(f"`{name}" in h for h in headings), f"docs/cli.md has no section on {name!r}"


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """`expstore query … | head`: the closed pipe is no error to report."""
    db = str(tmp_path / "x.duckdb")
    with _opened(db) as s:
        seed(s)
    proc = subprocess.Popen(
        [sys.executable, "-m", "expstore.cli", "query", "SELECT range AS n FROM range(300000)",
         "--db", db], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10)
    proc.stdout.close()  # as `head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == "", err


def test_a_server_with_auth_says_which_option_gives_the_token(tmp_path):
    from flight_fixtures import TOKENS, running_server, write_tokens
    tokens = write_tokens(tmp_path / "tokens.json")
    with running_server(tmp_path / "a.duckdb", tokens_file=tokens) as server:
        for extra in ([], ["--token", "not-a-valid-token"]):
            result = fails(invoke("tables", "--uri", server.location, *extra), 1,
                           "--token or EXPSTORE_TOKEN")
            assert "[unauthenticated]" not in result.output
        ok(invoke("tables", "--uri", server.location, "--token", TOKENS["reader"]))


@pytest.mark.parametrize("args, named", [
    (["a:int999"], "int999"), (["a:string", "--storage", "a=bogus"], "bogus"),
    (["a:string", "--required", "b"], "'b'"), (["a:int64", "--version-group", "1x"], "'1x'"),
])
def test_a_refused_table_definition_leaves_no_database_file(tmp_path, args, named):
    db = tmp_path / "new.duckdb"
    fails(invoke("create-table", "t", *args, "--db", str(db)), 1, named)
    assert list(tmp_path.iterdir()) == []


def test_json_output_is_json_that_any_parser_reads(backend, tmp_path):
    """NaN and infinities have no JSON number: Python's bare NaN broke `jq` and JavaScript."""
    with backend.open() as s:
        s.create_table("t", {"reward": "float64", "logprobs": "list<float64>"})
        s.put("t", [{"sample_id": "q0_0_0", "reward": float("nan"),
                     "logprobs": [float("-inf"), 0.5]},
                    {"sample_id": "q1_0_0", "reward": float("inf"), "logprobs": [1.0]}])
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} is not JSON")}
    out = json.loads(ok(backend.run("query", "SELECT sample_id, reward, logprobs FROM t "
                                    "ORDER BY 1", "--json")).stdout, **strict)
    assert out == [{"sample_id": "q0_0_0", "reward": "NaN", "logprobs": ["-Infinity", 0.5]},
                   {"sample_id": "q1_0_0", "reward": "Infinity", "logprobs": [1.0]}]
    target = tmp_path / "t.jsonl"
    ok(backend.run("export", "t", "-o", str(target)))
    rows = [json.loads(line, **strict) for line in target.read_text().splitlines()]
    assert [r["reward"] for r in rows] == ["NaN", "Infinity"]


def test_tls_to_a_server_without_tls_is_one_line_that_says_so(tmp_path):
    """gRPC logged every failed handshake and retry on stderr, a dozen lines above the error."""
    from flight_fixtures import running_server
    with running_server(tmp_path / "plain.duckdb") as server:
        uri = f"grpc+tls://127.0.0.1:{server.port}"
        proc = subprocess.run([sys.executable, "-m", "expstore.cli", "tables", "--uri", uri],
                              capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: no expstore server answers at grpc+tls://"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "serves no TLS (use grpc://)" in proc.stderr


def test_python_dash_m_expstore_is_the_console_script():
    """``python -m expstore`` runs the same commands as ``expstore`` (no ``__main__`` before)."""
    done = subprocess.run([sys.executable, "-m", "expstore", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m expstore" in done.stdout and "serve" in done.stdout


def test_stats_watch_keeps_watching_while_the_server_restarts(tmp_path):
    """An operator watching a server through its restart: each refresh it is down prints why
    (the CLI's words, not gRPC's), and the view comes back with the server."""
    import socket
    import time as _time

    from flight_server.server import ExpstoreFlightServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    db = str(tmp_path / "w.duckdb")

    def start() -> ExpstoreFlightServer:
        server = ExpstoreFlightServer(db, port=port)
        threading.Thread(target=server.serve, daemon=True).start()
        return server

    server = start()
    with store.connect(server.location) as s:
        s.create_table("t", {"a": "int64"})
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    watch = subprocess.Popen(
        [sys.executable, "-m", "expstore", "stats", "--watch", "--interval", "0.1", "--json",
         "--count", "100000", "--uri", f"grpc://127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        def next_line() -> dict[str, Any]:
            line = watch.stdout.readline()
            assert line, watch.stderr.read()
            return json.loads(line)

        assert "t" in next_line()
        server.close()
        deadline = _time.monotonic() + 60
        while "error" not in (down := next_line()):
            assert _time.monotonic() < deadline
        assert down["code"] == "unavailable"
        assert "Flight returned" not in down["error"], down
        server = start()
        while "t" not in (back := next_line()):
            assert _time.monotonic() < deadline
            assert "error" in back
        assert back["t"]["version"] == 0
    finally:
        watch.kill()
        watch.wait(30)
        server.close()
