"""docs/protocol.md from another language: examples/node, a Node.js client with no expstore code.

The example (gRPC with Arrow Flight's service definition, Arrow IPC with apache-arrow) creates a
table, writes rows in two do_put streams, claims a micro-batch, acks it, bumps the version,
writes, claims and acks one more row on an action session, reads the rows back with SQL and
makes two bad requests. This test runs it against a real server
and checks from Python, through the store's own client, that what it wrote is stored exactly,
that its claim is consumed and the version bumped, and that the summary it printed holds what
the protocol promises.

Skipped, with the reason, where ``node`` or ``npm`` is missing or ``npm ci`` cannot reach the
registry. The installed packages are kept in ``~/.cache/expstore/node-example/<lock hash>``
(``EXPSTORE_NODE_CACHE`` names another folder), so only the first run installs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import store
from flight_fixtures import running_server

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "node"
TABLE = "node_rollouts"
IDS = ["q1_0_0", "q1_0_1", "q2_0_0", "q2_0_1", "q3_0_0"]
# What the example writes (rollout_and_train.mjs), row by row: the first four at version 0, the
# last on the session at version 1.
WRITTEN = {
    "q1_0_0": {"prompt": "1+1?", "response": "2", "reward": 1.0,
               "token_ids": [17, 4, 2], "logprobs": [-0.5, -1.25]},
    "q1_0_1": {"prompt": "1+1?", "response": "two", "reward": 0.5,
               "token_ids": [], "logprobs": [-0.125]},
    "q2_0_0": {"prompt": 'say "ok" in ünïcode', "response": "ok ✓", "reward": 0.25,
               "token_ids": [9, 2147483647, -3], "logprobs": []},
    "q2_0_1": {"prompt": 'say "ok" in ünïcode', "response": "OK", "reward": -1.5,
               "token_ids": [5], "logprobs": [-2.0, -0.75, -0.0625]},
    "q3_0_0": {"prompt": "3+3?", "response": "6", "reward": 0.75,
               "token_ids": [6, 0], "logprobs": [-0.25]},
}
VERSIONS = {sid: 1 if sid == "q3_0_0" else 0 for sid in IDS}
NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT",
                  "ENETUNREACH", "EHOSTUNREACH", "network request")


def installed_node_modules() -> Path:
    """The example's packages as its package-lock.json pins them, installed once per lock."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: the Node.js client example cannot run")
    manifest = [(EXAMPLE / name).read_bytes() for name in ("package.json", "package-lock.json")]
    key = hashlib.sha256(b"\0".join(manifest)).hexdigest()[:16]
    root = Path(os.environ.get("EXPSTORE_NODE_CACHE",
                               Path.home() / ".cache" / "expstore" / "node-example"))
    installed = root / key
    if (installed / "node_modules").is_dir():
        return installed / "node_modules"
    work = root / f"{key}.installing-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        for name in ("package.json", "package-lock.json"):
            shutil.copy(EXAMPLE / name, work / name)
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefer-offline"],
                              cwd=work, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            output = done.stdout + done.stderr
            unreachable = [line for line in output.splitlines()
                           if any(error in line for error in NETWORK_ERRORS)]
            if unreachable:
                pytest.skip(f"npm ci cannot reach the npm registry: {unreachable[0].strip()}")
            pytest.fail(f"npm ci of examples/node failed ({done.returncode}):\n{output}")
        try:
            work.rename(installed)  # whole or not at all: a cut-short install is never used
        except OSError:
            if not (installed / "node_modules").is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return installed / "node_modules"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """A copy of examples/node with its packages installed, ready for ``node``."""
    modules = installed_node_modules()
    copy = tmp_path_factory.mktemp("node-example")
    for name in ("package.json", "flight.proto", "rollout_and_train.mjs"):
        shutil.copy(EXAMPLE / name, copy / name)
    (copy / "node_modules").symlink_to(modules, target_is_directory=True)
    return copy


def run_example(example: Path, port: int) -> dict[str, Any]:
    done = subprocess.run(["node", "rollout_and_train.mjs", f"127.0.0.1:{port}", TABLE],
                          cwd=example, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the Node client failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def test_node_client_follows_the_protocol(example, tmp_path):
    with running_server(tmp_path / "x.duckdb") as server:
        summary = run_example(example, server.port)
        s = store.connect(server.location)
        try:
            stored = s.query(
                f"SELECT sample_id, prompt, response, reward, token_ids, logprobs, policy_version,"
                f" consumed, consumed_version, is_processing FROM {TABLE} ORDER BY sample_id")
            element_types = {name: str(stored.schema.field(name).type.value_type)
                             for name in ("token_ids", "logprobs")}
            rows = stored.to_pylist()
            version = s.get_version(TABLE)
            stats = s.stats()[TABLE]
            again = s.ack(summary["claim"]["claim_id"])
        finally:
            s.close()

    # What the Node client wrote is stored exactly, in the table's types.
    assert element_types == {"token_ids": "int32", "logprobs": "float"}
    assert str(stored.schema.field("reward").type) == "double"
    assert {r["sample_id"]: {k: r[k] for k in WRITTEN["q1_0_0"]} for r in rows} == WRITTEN
    assert {r["sample_id"]: r["policy_version"] for r in rows} == VERSIONS
    # Its first claim took the first three rows in the documented order and its ack consumed
    # them before the bump; the session's claim took the row written after it.
    claimed = IDS[:3]
    assert {r["sample_id"]: r["consumed_version"] for r in rows if r["consumed"]} == {
        **{sid: 0 for sid in claimed}, "q3_0_0": 1}
    assert not any(r["is_processing"] for r in rows)
    # The bump (max_staleness 0) made the one row left unclaimed stale.
    assert (stats["consumed"], stats["stale"], stats["ready"], stats["processing"]) == (4, 1, 0, 0)
    assert again["duplicate"] is True and again["acked"] == 3
    assert version == 1

    # What it saw on the wire.
    assert summary["created"] == {"version": 0, "columns": [
        ["prompt", "string"], ["response", "string"], ["reward", "float64"],
        ["token_ids", "list<int32>"], ["logprobs", "list<float32>"]]}
    assert summary["write_schema"][:3] == [
        ["sample_id", "LargeUtf8"], ["policy_version", "Int64"], ["finished_version", "Int64"]]
    assert ["token_ids", "LargeList<Int32>"] in summary["write_schema"]
    assert ["logprobs_status", "Bool"] in summary["write_schema"]
    assert summary["put_answers"] == [
        [{"batch": 0, "rows": 2, "version": 0}, {"batch": 1, "rows": 2, "version": 0}],
        [{"batch": 0, "rows": 4, "version": 0}]]

    claim = summary["claim"]
    assert claim["claim_id"] and claim["consumer"] == "node-trainer"
    assert claim["tables"] == {TABLE: 3} and claim["expires_in_future"] is True
    assert claim["schema_table"] == TABLE
    assert claim["columns"][:7] == ["sample_id", "input_id", "turn", "trajectory_id",
                                    "policy_version", "finished_version", "delivery_count"]
    assert claim["rows"] == [
        {"sample_id": sid, "input_id": sid.split("_")[0], "trajectory_id": int(sid[-1]),
         "reward": WRITTEN[sid]["reward"], "token_ids": WRITTEN[sid]["token_ids"],
         "delivery_count": 1} for sid in claimed]
    assert summary["ack"] == {"claim_id": claim["claim_id"], "acked": 3}
    assert summary["bump"] == {"table": TABLE, "version": 1, "weights_uri": None}
    session = summary["session"]
    assert session["put"] == {"rows": 1, "version": 1}
    assert session["claim"]["claim_id"] not in ("", claim["claim_id"])
    assert session["claim"]["tables"] == {TABLE: 1}
    assert session["claim"]["sample_ids"] == ["q3_0_0"]
    assert session["ack"] == {"claim_id": session["claim"]["claim_id"], "acked": 1}
    assert summary["sql_rows"] == [
        {"sample_id": sid, **WRITTEN[sid], "policy_version": VERSIONS[sid],
         "consumed": sid != "q2_0_1"} for sid in IDS]

    # Bad requests surface as the typed errors of docs/protocol.md, "Errors".
    unknown = summary["error"]
    assert (unknown["grpc_code_name"], unknown["extra_info"]) == ("UNKNOWN", {"code": "not_found"})
    assert unknown["message"].startswith("[not_found] table 'no_such_table' does not exist")
    bad_id = summary["put_error"]
    assert (bad_id["grpc_code_name"], bad_id["extra_info"]) == (
        "UNKNOWN", {"code": "invalid_argument"})
    assert bad_id["message"].startswith("[invalid_argument] sample_id 'q4_00_0'")
    assert "write it as 'q4_0_0'" in bad_id["message"]
