"""Importing the service and its clients does no work: no database is opened, and no optional
heavy framework (torch, DeepSpeed, vLLM, Ray) is loaded unless the part that needs it is used."""
from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("torch", "deepspeed", "vllm", "ray", "transformers")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_importing_the_service_and_clients_loads_no_heavy_framework():
    loaded = _run(f"""
        import sys
        import store, store.embedded, flight_server, flight_server.server, flight_server.client
        import producers, consumers, expstore, expstore.cli
        import flight_server.cluster.coordinator, flight_server.cluster.datanode
        import flight_server.cluster.client, flight_server.cluster.ray_cluster
        print(",".join(m for m in {HEAVY!r} if m in sys.modules))
    """)
    assert loaded == "", f"imported at module level: {loaded}"


def test_importing_the_store_opens_no_database_until_sql_is_checked():
    state = _run("""
        import store, store.sqlguard as g
        before = g._parser is None
        g.check_select("SELECT 1")
        print(before, g._parser is not None)
    """)
    assert state == "True True"
