"""A rollout process writing through ExperienceWriter, killed with SIGKILL in the middle of its puts.

What it flushed is stored whole; what it wrote after is at most half there (a sample with its
first part and no reward is not ready, so no trainer gets it); the restarted rollout writes the
same samples again and a trainer then consumes every sample exactly once. Real components: a
Flight server on 127.0.0.1 over a DuckDB file, the producer in a subprocess of its own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import store
from flight_fixtures import running_server
from producers import ExperienceWriter

import reliability_helpers as rh

# Writes samples in two parts (generation, then reward) and says how many it has flushed; it
# never stops by itself, so the kill lands among puts on their way.
_PRODUCER = r"""
import json, sys
from producers import ExperienceWriter
w = ExperienceWriter(sys.argv[1], "t", batch_rows=8, puts_in_flight=4, flush_interval=0.01)
i = 0
while True:
    w.write({"sample_id": f"q{i}_0_0", "prompt": "p" * 64})
    w.write({"sample_id": f"q{i}_0_0", "reward": float(i)})
    i += 1
    if i % 16 == 0:
        w.flush(timeout=60)
        print(json.dumps({"flushed": i}), flush=True)
"""


def test_a_producer_killed_mid_put_loses_nothing_flushed_and_a_restart_doubles_nothing(tmp_path):
    with running_server(tmp_path / "x.duckdb") as server, store.connect(server.location) as s:
        s.create_table("t", {"prompt": "string", "reward": "float64"})
        env = dict(os.environ, PYTHONPATH=str(rh.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, server.location],
                                cwd=str(rh.ROOT), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        flushed = 0
        try:
            while flushed < 64:
                line = proc.stdout.readline()
                assert line, f"the producer died: {proc.stderr.read()[-2000:]}"
                flushed = json.loads(line)["flushed"]
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()

        rows = s.query("SELECT sample_id, prompt, reward FROM t").to_pylist()
        stored = {r["sample_id"]: r for r in rows}
        assert len(stored) == len(rows)                                    # one row per sample
        for i in range(flushed):                                           # flushed: whole
            assert stored[f"q{i}_0_0"]["reward"] == float(i)
        ready = s.stats("t")["t"]["ready"]
        assert ready == sum(r["prompt"] is not None and r["reward"] is not None for r in rows)

        # The restarted rollout writes from the start again (it cannot know what reached the
        # store); a trainer then gets every sample once.
        total = (len(stored) // 8 + 2) * 8                                 # whole micro-batches
        with ExperienceWriter(s, "t", batch_rows=8) as w:
            for i in range(total):
                w.write({"sample_id": f"q{i}_0_0", "prompt": "p" * 64, "reward": float(i)})
        seen: list[str] = []
        with s.subscribe("t", micro_batch_size=8, global_batch_size=total,
                         idle_timeout=30) as sub:
            for mb in sub:
                seen += mb.data.column("sample_id").to_pylist()
                mb.ack()
                if mb.is_boundary:
                    break
        assert sorted(seen) == sorted(f"q{i}_0_0" for i in range(total))
        stats = s.stats("t")["t"]
        assert (stats["rows"], stats["consumed"], stats["ready"]) == (total, total, 0)
