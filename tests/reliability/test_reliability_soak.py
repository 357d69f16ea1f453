"""Soak, short: ``scripts/soak.py`` for ~20 s with 8 producer and 2 consumer connections.

The full soak (64 producers, 8 consumers, minutes) is ``python scripts/soak.py`` or the ``slow``
test below; its figures are in docs/reliability.md.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def _soak():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _check(summary: dict) -> None:
    assert summary["errors"] == 0
    assert summary["lost"] == summary["duplicated"] == 0
    assert summary["rows"] == summary["consumed"] > 0
    assert summary["rss_samples"] > 0 and summary["rss_max_mb"] < summary["rss_limit_mb"]


def test_short_soak_has_no_errors_no_loss_and_bounded_memory(tmp_path):
    summary = _soak().run_soak(tmp_path, seconds=20, producers=8, consumers=2,
                               drain_seconds=60)
    _check(summary)
    print(summary)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_soak_64_producers_8_consumers(tmp_path):
    summary = _soak().run_soak(tmp_path, seconds=300, producers=64, consumers=8)
    _check(summary)
    print(summary)
