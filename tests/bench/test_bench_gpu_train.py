"""bench/gpu_train.py on the CPU, with a model a thousand times smaller: the benchmark's own code
(both feeds, the timing of waits, acks and bumps, the figures) keeps working where CI has no GPU.

Slow (about a minute on 2 cores): ``pytest -m slow tests/bench/test_bench_gpu_train.py``. The real run
needs a CUDA device (``python -m bench --only gpu_train``).
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
try:
    import deepspeed  # noqa: F401
except Exception as e:  # noqa: BLE001 - an import of deepspeed can fail in many ways
    pytest.skip(f"deepspeed is not importable ({type(e).__name__}: {e})", allow_module_level=True)

from bench import gpu_train  # noqa: E402
from bench.context import Ctx, Results  # noqa: E402
from producers.rollout.tiny_lm import TinyLMConfig  # noqa: E402


@pytest.mark.slow
def test_both_feeds_train_and_the_figures_are_recorded(tmp_path) -> None:
    results, cleanup = Results(), []
    ctx = Ctx("gpu_train", results, tmp_path / "out", quick=True, cleanup=cleanup)
    try:
        gpu_train.measure(ctx, "cpu", TinyLMConfig(d_model=32, n_layers=1, n_heads=2,
                                                    max_seq_len=gpu_train.TOKENS))
    finally:
        for stop in reversed(cleanup):
            stop()
    got = {k.split(".", 1)[1]: m.value for k, m in results.metrics.items()}
    assert got["memory_step_ms"] > 0 and got["store_step_ms"] > 0
    assert got["store_vs_memory"] == pytest.approx(got["memory_step_ms"] / got["store_step_ms"])
    assert 0 <= got["store_waiting_fraction"] < 100 and 0 <= got["store_acks_fraction"] < 100
    assert 0 < got["store_bumps_fraction"] < 100  # the store-fed phases bumped, the memory ones not
    spent = results.series["gpu_train.steps"]["spent"]
    assert all(f["bumps"] < 1e-3 and f["acks"] < 0.05 for f in spent["memory"])  # no store there
    assert len(results.series["gpu_train.steps"]["ms"]["store"]) == 2 * 3  # 2 rounds x 3 steps
