"""The README's Python blocks run as a new user runs them: one after another, in one session,
against a real server (its address put where the README says 127.0.0.1:8815)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flight_fixtures import running_server

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_its_python_blocks():
    assert len(python_blocks()) >= 3


@pytest.mark.filterwarnings("error")  # what a user would see, e.g. ADBC's autocommit warning
def test_the_readme_python_blocks_run_in_order_on_one_server(tmp_path, capsys):
    pytest.importorskip("adbc_driver_flightsql")
    with running_server(tmp_path / "readme.duckdb") as server:
        namespace: dict = {}
        for block in python_blocks():
            code = block.replace("grpc://127.0.0.1:8815", server.location)
            exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
        namespace["conn"].close()
        namespace["critic"].close()
        namespace["s"].close()
    out = capsys.readouterr().out
    assert "3 16 True" in out  # the quick start's last micro-batch is a boundary
