"""The pipeline simulation (bench/pipeline_sim.py) through a real server, time scaled far down.

No timing is asserted: these check that the simulation moves every sample through the store once,
in the micro-batches and global batches it says, and that what it does before timing (each
rollout worker's first put, which opens its connection's stream) stays out of the measured table.
"""
from __future__ import annotations

import pytest

import store
from bench.pipeline_sim import ROLLOUT_WORKERS, SimConfig, rollout_latencies, simulate
from bench.sim_transports import ExpstoreTransport, IdealTransport
from flight_fixtures import running_server

# 2 global batches of 16 samples in micro-batches of 4; the 1.7 s straggler becomes 34 ms.
TINY = SimConfig(global_batch=16, micro_batch=4, global_batches=2).scaled(0.02)


def _check_run(result: dict, cfg: SimConfig, mode: str) -> None:
    samples = cfg.global_batch * cfg.global_batches
    assert len(result["arrivals"]) == samples
    steps = cfg.global_batch // cfg.micro_batch if mode == "micro" else 1
    assert len(result["train"]) == steps * cfg.global_batches
    assert len(result["bumps"]) == cfg.global_batches
    assert result["bumps"] == sorted(result["bumps"])
    # every training step lies within the run, which ends with its last bump
    for start, end in result["train"]:
        assert 0 < start < end <= result["seconds"]


@pytest.mark.parametrize("mode", ["sync", "micro"])
def test_the_simulation_moves_each_sample_through_the_server_once(tmp_path, mode):
    with running_server(tmp_path / "sim.duckdb") as server:
        transport = ExpstoreTransport(server.location, "sim")
        try:
            before = transport.version()
            result = simulate(transport, TINY, rollout_latencies(TINY), mode)
            assert transport.version() == before + TINY.global_batches
        finally:
            transport.close()
        s = store.connect(server.location)
        try:
            counts = s.query("SELECT count(*) AS n, count(DISTINCT sample_id) AS ids, "
                             "count(*) FILTER (WHERE NOT is_processing AND consumed) AS acked "
                             "FROM sim").to_pylist()[0]
            warmup = s.query("SELECT count(*) AS n FROM sim_warmup").to_pylist()[0]["n"]
        finally:
            s.close()
    _check_run(result, TINY, mode)
    samples = TINY.global_batch * TINY.global_batches
    assert counts == {"n": samples, "ids": samples, "acked": samples}
    # one warm-up put per rollout worker, in a table of its own
    assert warmup == ROLLOUT_WORKERS


def test_the_ideal_queue_runs_the_same_schedule():
    cfg = TINY
    _check_run(simulate(IdealTransport(), cfg, rollout_latencies(cfg), "micro"), cfg, "micro")
