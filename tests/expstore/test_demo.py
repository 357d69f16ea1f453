"""``expstore demo --quick``: runs end to end, twice on the same file, and explains itself."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

import store  # noqa: E402
from consumers import demo  # noqa: E402
from devices import CUDA  # noqa: E402

AGENTS = ("planner", "solver", "verifier")
PER_QUERY = {"planner": 2, "solver": 4, "verifier": 8}  # n = 2


def check_quick_summary(summary: dict, run: int) -> None:
    """What every --quick run's summary must say, whatever the device."""
    assert summary["run"] == run and summary["tables"] == f"demo{run}_*"
    assert summary["samples"] == 112 and summary["rounds"] == 2 and summary["queries"] == 8
    for name in AGENTS:
        a = summary["agents"][name]
        assert a["table"] == f"demo{run}_{name}"
        assert a["version"] == a["steps"] == 2
        assert a["samples"] == a["consumed"] == 8 * PER_QUERY[name]
        assert 0 <= a["hidden_seconds"] <= a["train_seconds"]
    assert 0 < summary["hidden_train_seconds"] <= summary["train_seconds"]
    assert 0 <= summary["hidden_fraction"] <= 1
    assert summary["sync_estimate_seconds"] == pytest.approx(
        summary["rollout_seconds"] + summary["train_seconds"], abs=0.01)
    assert summary["saved_seconds"] == pytest.approx(
        summary["sync_estimate_seconds"] - summary["wall_seconds"], abs=0.01)
    assert summary["rollout_latency_max"] >= summary["rollout_latency_p95"] \
        >= summary["rollout_latency_p50"] > 0


def test_quick_demo_twice_on_one_file(tmp_path, capsys) -> None:
    db = str(tmp_path / "expstore.duckdb")

    assert demo.main(["--db", db, "--quick"]) == 0
    text = capsys.readouterr().out
    assert "expstore demo run 1" in text and "grpc://127.0.0.1:" in text
    assert "| planner v" in text  # progress lines (not a terminal: plain lines)
    for needle in ("Done: 112 samples from 8 queries", "synchronous estimate",
                   "training hidden in rollouts", "this run (pipelined)", "saved",
                   "slowest query", "demo1_verifier"):
        assert needle in text, needle

    # a second run on the same file: fresh tables, the first run's data untouched
    assert demo.main(["--db", db, "--quick", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "| verifier v" in captured.err  # with --json, progress goes to stderr
    check_quick_summary(summary, run=2)
    assert summary["device"] == "cpu"

    with store.connect(db) as s:
        tables = set(s.list_tables())
        assert {f"demo{r}_{a}" for r in (1, 2) for a in AGENTS} <= tables
        for r in (1, 2):
            for name in AGENTS:
                stats = s.stats(f"demo{r}_{name}")[f"demo{r}_{name}"]
                assert stats["rows"] == stats["consumed"] == 8 * PER_QUERY[name]
                assert stats["version"] == 2


def test_interval_arithmetic() -> None:
    assert demo.union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert demo.overlap_seconds([(0, 2), (1, 3), (5, 6)], [(2.5, 5.5), (10, 11)]) == 1.0
    assert demo.overlap_seconds([], [(0, 1)]) == 0


def test_bad_arguments_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        demo.main(["--n", "1", "--quick"])
    for device, says in (("tpu", "not a torch device"), ("cuda:99", "CUDA device"),
                         ("meta", "expected cpu or cuda")):
        with pytest.raises(SystemExit):
            demo.main(["--quick", "--device", device])
        err = capsys.readouterr().err
        assert f"--device {device!r}" in err and says in err, err


@pytest.mark.parametrize("device", [CUDA])
def test_quick_demo_on_cuda(tmp_path, device: str) -> None:
    """The whole pipeline with every model rolling out and training on the GPU."""
    summary = demo.run_demo(str(tmp_path / "gpu.duckdb"), config=demo.QUICK, device=device)
    check_quick_summary(summary, run=1)
    assert summary["device"] == "cuda"


def run_console(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``expstore ARGS`` in a process of its own, as a user runs it: what native modules
    (gRPC, DuckDB) write on the process's stderr is in ``stderr`` too."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-c", "from expstore.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_the_console_script_ends_with_the_summary(tmp_path) -> None:
    """`expstore demo` as a user runs it: exit status 0 and the summary last on the terminal
    (no teardown noise from native modules after it)."""
    db = str(tmp_path / "console.duckdb")
    done = run_console(tmp_path, "demo", "--db", db, "--quick")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "expstore query --db" in done.stdout.strip().splitlines()[-1]
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_a_port_in_use_is_one_line_naming_it(tmp_path) -> None:
    """Before, gRPC's C-core log lines ("Failed to add port to server", "Server did not start
    properly") came above the demo's own message; now the port is checked as `expstore serve`
    checks it, before anything starts."""
    db = tmp_path / "busy.duckdb"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_console(tmp_path, "demo", "--db", str(db), "--port", str(port), "--quick")
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in lines[0] and "--port" in lines[0], lines
    assert done.stdout == "" and not db.exists()
