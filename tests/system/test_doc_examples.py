"""The Python examples of the README and docs/protocol.md run as a new user runs them: the
blocks of one page one after another, in one session, against a real server (its address put
where the page says 127.0.0.1:8815)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flight_fixtures import running_server

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def run_blocks(page: Path, location: str) -> dict:
    namespace: dict = {}
    for block in python_blocks(page):
        code = block.replace("grpc://127.0.0.1:8815", location)
        exec(compile(code, str(page), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def test_the_pages_have_their_python_blocks():
    assert len(python_blocks(ROOT / "README.md")) >= 3
    assert len(python_blocks(ROOT / "docs" / "protocol.md")) >= 1


@pytest.mark.filterwarnings("error")  # what a user would see, e.g. ADBC's autocommit warning
def test_the_readme_python_blocks_run_in_order_on_one_server(tmp_path, capsys):
    pytest.importorskip("adbc_driver_flightsql")
    with running_server(tmp_path / "readme.duckdb") as server:
        namespace = run_blocks(ROOT / "README.md", server.location)
        namespace["conn"].close()
        namespace["critic"].close()
        namespace["s"].close()
    out = capsys.readouterr().out
    assert "3 16 True" in out  # the quick start's last micro-batch: a boundary
    assert "torch.bfloat16 (2, 2, 4)" in out  # values in 16 bits


def test_the_protocol_page_raw_pyarrow_session_runs(tmp_path):
    with running_server(tmp_path / "protocol.duckdb") as server:
        namespace = run_blocks(ROOT / "docs" / "protocol.md", server.location)
        assert namespace["rows"].num_rows == 1  # the sample written in parts was claimed
        assert server.store.stats("solver")["solver"]["consumed"] == 1
        assert server.store.get_version("solver") == 1
        namespace["c"].close()
