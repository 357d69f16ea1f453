"""``python -m bench`` as a user runs it: a subprocess, its results file and its output."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_writes_its_figures_and_exits_without_leak_reports(tmp_path):
    # duckdb_bulk creates a store catalog (DuckDB under SQLAlchemy); the benchmark after it
    # freezes what that left (gc.freeze), and the run must unfreeze it before the interpreter
    # exits, or DuckDB's bindings print a leak report on the way out.
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "duckdb_bulk,redis_streams",
         "--no-plots", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["metrics"]["duckdb_bulk.narrow_rows_per_s"]["value"] > 0
    # Redis ran, or was skipped with its reason (no redis-server or redis-py here)
    assert "redis_streams.narrow_rows_per_s" in results["metrics"] or \
        "redis_streams" in results["skipped"]
    assert "leaked" not in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_every_benchmark_module_imports_and_lists_its_title():
    """``--list`` imports every benchmark module: a name one imports from another that is
    gone (the cluster benchmark's TransferQueue helpers) fails here, not after a long run."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cluster" in proc.stdout and "transferqueue" in proc.stdout
