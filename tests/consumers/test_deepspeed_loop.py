"""The DeepSpeed consumer loop (world size 1, ZeRO 0 to 3) against a plain torch step.

DeepSpeed picks its accelerator itself: the CPU one (gloo) on a machine without a GPU, CUDA (NCCL)
where torch sees one, so on a GPU machine every test here trains on the GPU; the references are
computed on the same device. The micro-batch items in most tests are plain objects with the
subscription's shape (``data``, ``index``, ``is_boundary``, ``ack``); the last tests take them from
the store's subscriptions, embedded and through the Flight server.
"""
from __future__ import annotations

import contextlib
import copy
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

try:
    import deepspeed
except Exception as e:  # noqa: BLE001 - an import of deepspeed can fail in many ways (no torch ext, no compiler)
    deepspeed = None
    _DS_REASON = f"deepspeed is not importable ({type(e).__name__}: {e}); pip install --no-build-isolation deepspeed"
else:
    _DS_REASON = ""

from consumers.grpo import clipped_policy_loss, group_advantages, token_logprobs  # noqa: E402
from consumers.torch_collate import TorchBatch, collate  # noqa: E402
from producers.rollout.tiny_lm import TinyCausalLM, build_tiny_lm  # noqa: E402
from producers.rollout.weights import load_state_dict  # noqa: E402

pytestmark = pytest.mark.skipif(deepspeed is None, reason=_DS_REASON)


def ds_device() -> str:
    """Where DeepSpeed puts the engine's model: ``cpu`` or ``cuda``."""
    from deepspeed.accelerator import get_accelerator

    return "cpu" if get_accelerator().device_name() == "cpu" else "cuda"


def tolerances() -> dict[str, float]:
    # A GPU sums a micro-batch's gradient in another order than the full batch's: float32
    # rounding of a few ulps, amplified by the steps (still far below the 1e-2 they move).
    return {"rtol": 1e-5, "atol": 1e-6} if ds_device() == "cpu" else {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def single_process_group() -> Iterator[None]:
    """DeepSpeed needs a torch.distributed group; without these variables it tries MPI and fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Item:
    data: pa.Table
    index: int
    is_boundary: bool
    log: list[str] = field(default_factory=list)

    def ack(self, wait: bool = True) -> None:
        self.log.append(f"ack {self.data.column('sample_id')[0].as_py()}")


def make_global_batch(seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(2):
        for k in range(4):
            p = int(rng.integers(2, 4))
            n = p + int(rng.integers(1, 7))
            rows.append({"sample_id": f"s{seed}_{g}_{k}", "input_id": f"q{seed}_{g}", "prompt_len": p,
                         "token_ids": [256, *rng.integers(0, 256, n - 1).tolist()],
                         "logprobs": (-rng.uniform(5.0, 6.0, n - p)).tolist(), "reward": float(rng.integers(0, 2))})
    t = pa.Table.from_pylist(rows)
    b = collate(t)
    return t.append_column("advantage", pa.array(group_advantages(b.rewards, b.group_ids).numpy(), pa.float32()))  # type: ignore[arg-type]


def grpo_loss(model: torch.nn.Module, b: TorchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    lp = token_logprobs(model(b.input_ids, b.position_ids), b.input_ids)
    return clipped_policy_loss(lp, b.old_logprobs, b.per_token(b.advantages), b.loss_mask)  # type: ignore[arg-type]


SPLITS = [[3, 5], [2, 2, 4]]  # micro-batch sizes per global batch: unequal, and a varying number of them


def items(batches: list[pa.Table], log: list[str]) -> list[Item]:
    out = []
    for t, sizes in zip(batches, SPLITS):
        start = 0
        for i, s in enumerate(sizes):
            out.append(Item(t.slice(start, s), i, i == len(sizes) - 1, log))
            start += s
    return out


def optimizer(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # SGD with momentum: linear in the gradients, so float32 rounding stays at float32 size. Adam
    # divides near-zero gradients by their own tiny magnitude and turns rounding into visible update
    # differences (DeepSpeed refuses float64 gradients, so no tighter dtype is available).
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference_params(model: TinyCausalLM, batches: list[pa.Table], clip: float,
                     loss_fn: Any = None) -> list[torch.Tensor]:
    """Plain torch: one optimizer step per global batch, on all of it at once (``grpo_loss``
    unless ``loss_fn``)."""
    model = model.to(ds_device())
    opt = optimizer(model.parameters())
    for t in batches:
        opt.zero_grad()
        loss_sum, n = (loss_fn or grpo_loss)(model, collate(t).to(ds_device()))
        (loss_sum / n).backward()
        if clip:
            # the norm of the *global* gradient is clipped, so the accumulated gradient must be complete first
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("zero_stage,managed,clip", [(0, False, 0.0), (1, False, 0.0), (0, False, 1.0), (1, True, 1.0)])
def test_loop_matches_full_batch_torch_steps(tmp_path, zero_stage: int, managed: bool, clip: float) -> None:
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config

    batches = [make_global_batch(1), make_global_batch(2)]
    model = build_tiny_lm(seed=5)
    initial = [p.detach().clone() for p in model.parameters()]
    expected = reference_params(copy.deepcopy(model), batches, clip)

    extra = {"managed_gradient_accumulation": True} if managed else None
    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8, zero_stage=zero_stage, gradient_clipping=clip, extra=extra)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()), config=cfg)

    log: list[str] = []
    versions = iter(range(1, 100))

    def bump_version(*, weights_uri: str) -> int:
        log.append(f"bump {weights_uri}")
        return next(versions)

    loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path / "weights")
    reports = list(loop.run(items(batches, log), bump_version))

    assert [r.step for r in reports] == [1, 2] and [r.version for r in reports] == [1, 2]
    assert [r.micro_batches for r in reports] == [2, 3]
    assert reports[0].count == collate(batches[0]).num_loss_tokens
    assert next(engine.module.parameters()).device.type == ds_device()
    for p, e in zip(engine.module.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, **tolerances())
    moved = max(float((p.detach().cpu() - p0).abs().max()) for p, p0 in zip(engine.module.parameters(), initial))
    assert moved > 1e-2  # the steps happened, and are far larger than the tolerance
    published = load_state_dict(reports[-1].weights_uri)
    for k, v in engine.module.state_dict().items():
        torch.testing.assert_close(published[k], v.cpu())
    # every micro-batch acked right after its backward, each bump names the file just published
    assert [line.split()[0] for line in log] == ["ack", "ack", "bump", "ack", "ack", "ack", "bump"]
    assert log[2] == f"bump {reports[0].weights_uri}"


def sample_mean_loss(model: torch.nn.Module, b: TorchBatch) -> tuple[torch.Tensor, int]:
    """A policy-gradient surrogate averaged per sample: its global denominator (8 samples) is known."""
    from consumers.accumulation import reduce_loss

    lp = token_logprobs(model(b.input_ids, b.position_ids), b.input_ids)
    per_token = -(lp - b.old_logprobs).exp() * b.per_token(b.advantages)  # type: ignore[operator, arg-type]
    return reduce_loss(per_token, b.loss_mask, b.segment_ids, b.num_samples, level="sample")


def test_zero_stage_2_with_a_known_denominator_matches_full_batch_steps(tmp_path) -> None:
    """ZeRO 2 reduces gradients at every micro-step, out of .grad: the loop then needs the global
    count up front (here 8 samples per global batch, a sample-mean loss)."""
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config

    batches = [make_global_batch(1), make_global_batch(2)]
    model = build_tiny_lm(seed=5)
    initial = [p.detach().clone() for p in model.parameters()]
    expected = reference_params(copy.deepcopy(model), batches, clip=0.0, loss_fn=sample_mean_loss)

    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8, zero_stage=2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()), config=cfg)
    loop = DeepSpeedTrainLoop(engine, sample_mean_loss, tmp_path / "weights", global_count=8)
    reports = list(loop.run(items(batches, []), lambda *, weights_uri: None))

    assert [(r.step, r.micro_batches, r.count) for r in reports] == [(1, 2, 8), (2, 3, 8)]
    for p, e in zip(engine.module.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, **tolerances())
    moved = max(float((p.detach().cpu() - p0).abs().max()) for p, p0 in zip(engine.module.parameters(), initial))
    assert moved > 1e-2
    # without the count the loop would rescale gradients that ZeRO 2 no longer keeps: refused
    with pytest.raises(ValueError, match="ZeRO stage 2 .* pass global_count"):
        DeepSpeedTrainLoop(engine, sample_mean_loss, tmp_path / "weights")


def test_ack_at_step_defers_acks_and_max_steps_stops(tmp_path) -> None:
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config

    model = build_tiny_lm(seed=6)
    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8, zero_stage=0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    log: list[str] = []
    loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path, ack_at_step=True, keep_last=1)
    before = copy.deepcopy(engine.module.state_dict())
    reports = list(loop.run(items([make_global_batch(3), make_global_batch(4)], log),
                            lambda *, weights_uri: log.append("bump") or 7, max_steps=1))
    assert len(reports) == 1 and reports[0].version == 7
    assert log == ["ack s3_0_0", "ack s3_0_3", "bump"]
    assert any(not torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".pt"] == ["policy-step00000001.pt"]


def test_config_rejects_indivisible_batch_sizes() -> None:
    from consumers.deepspeed_loop import deepspeed_config

    with pytest.raises(ValueError, match="not a multiple"):
        deepspeed_config(micro_batch_size=3, global_batch_size=8)


@pytest.mark.parametrize("via", ["embedded", "flight"])
def test_loop_on_a_real_store_subscription(tmp_path, via: str) -> None:
    """End to end with the store: claims become micro-batches, the boundary bumps the table's version."""
    store = pytest.importorskip("store", reason="the store package is not importable")
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config
    from flight_fixtures import running_server
    from flight_server.client import RemoteStore

    with contextlib.ExitStack() as stack:
        if via == "embedded":
            s = stack.enter_context(store.connect(str(tmp_path / "x.duckdb")))
        else:
            server = stack.enter_context(running_server(tmp_path / "x.duckdb"))
            s = stack.enter_context(RemoteStore(server.location))
        s.create_table("solver", {"token_ids": "list<int32>", "logprobs": "list<float32>", "prompt_len": "int32",
                                  "reward": "float64", "advantage": "float32"})
        t = make_global_batch(5).drop_columns(["input_id"])
        s.put("solver", t)
        sub = stack.enter_context(contextlib.closing(
            s.subscribe("solver", micro_batch_size=4, global_batch_size=8, idle_timeout=5)))
        model = build_tiny_lm(seed=8)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()),
                                          config=deepspeed_config(micro_batch_size=4, global_batch_size=8))
        loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path / "weights")
        reports = list(loop.run(sub, sub.bump_version, max_steps=1))
        assert len(reports) == 1 and reports[0].version == 1 == s.get_version("solver")
        assert reports[0].micro_batches == 2 and reports[0].count == collate(t).num_loss_tokens
        assert load_state_dict(reports[0].weights_uri).keys() == engine.module.state_dict().keys()
        assert s.stats("solver")["solver"]["consumed"] == 8


def test_a_float64_model_is_refused_before_training_naming_the_cause(tmp_path) -> None:
    """DeepSpeed itself fails only at the end of the first global batch, with an assertion
    naming neither the model nor the fix; the loop refuses the engine when it is made."""
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config

    model = build_tiny_lm(seed=5).double()
    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()), config=cfg)
    with pytest.raises(TypeError, match=r"parameters are torch\.float64 .* model\.float\(\)"):
        DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path / "weights")


def zero3_loop_from_store(tmp_path) -> None:
    """ZeRO-3 fed by a subscription through the Flight server: after two global batches its
    parameters (gathered) and the published weights equal plain torch steps on the same
    micro-batches, accumulated the same way."""
    from consumers.accumulation import GradientAccumulator
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config, full_state_dict
    from flight_fixtures import running_server
    from flight_server.client import RemoteStore

    clip, global_count = 1.0, 8
    model = build_tiny_lm(seed=8)
    reference = copy.deepcopy(model).to(ds_device())
    # Release every parameter right after use, as with a model too large to keep gathered (a tiny
    # model on one rank otherwise stays gathered between steps, hiding a missing gather).
    zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
             "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8, zero_stage=3, gradient_clipping=clip,
                           extra={"zero_optimization": zero3})
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()), config=cfg)
    assert engine.zero_optimization_stage() == 3
    with pytest.raises(ValueError, match="ZeRO stage 3 .* pass global_count"):
        DeepSpeedTrainLoop(engine, sample_mean_loss, tmp_path / "weights")

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_server(tmp_path / "x.duckdb"))
        s = stack.enter_context(RemoteStore(server.location))
        s.create_table("solver", {"token_ids": "list<int32>", "logprobs": "list<float32>", "prompt_len": "int32",
                                  "reward": "float64", "advantage": "float32"},
                       max_staleness=1)  # the second global batch is still trainable after the first bump
        for seed in (5, 6):
            s.put("solver", make_global_batch(seed).drop_columns(["input_id"]))
        sub = stack.enter_context(contextlib.closing(
            s.subscribe("solver", micro_batch_size=4, global_batch_size=8, idle_timeout=5)))
        seen: list[tuple[pa.Table, bool]] = []

        def recorded() -> Iterator[Any]:
            for mb in sub:
                seen.append((mb.data, bool(mb.is_boundary)))
                yield mb

        loop = DeepSpeedTrainLoop(engine, sample_mean_loss, tmp_path / "weights", global_count=global_count)
        reports = list(loop.run(recorded(), sub.bump_version, max_steps=2))
        assert [(r.step, r.version, r.micro_batches, r.count) for r in reports] == [(1, 1, 2, 8), (2, 2, 2, 8)]
        assert s.get_version("solver") == 2 and s.stats("solver")["solver"]["consumed"] == 16
    # the parameters really are partitioned: outside a gather the module holds empty placeholders
    assert all(p.numel() == 0 for p in engine.module.parameters())

    # plain torch on the same micro-batches, in the same order, with the same scaling and clipping
    opt = optimizer(reference.parameters())
    acc = GradientAccumulator(reference.parameters(), global_count=global_count)
    opt.zero_grad()
    for data, boundary in seen:
        acc.backward(*sample_mean_loss(reference, collate(data).to(ds_device())), is_last=boundary)
        if boundary:
            acc.finish()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            opt.step()
            opt.zero_grad()
    expected = {k: v.detach().cpu() for k, v in reference.state_dict().items()}

    trained = full_state_dict(engine)
    published = load_state_dict(reports[-1].weights_uri)
    assert trained.keys() == published.keys() == expected.keys()
    for k, e in expected.items():
        torch.testing.assert_close(trained[k].cpu(), e, **tolerances())
        torch.testing.assert_close(published[k], e, **tolerances())
    moved = max(float((e - v.cpu()).abs().max()) for e, v in zip(expected.values(), model_state(8).values()))
    assert moved > 1e-2  # the steps happened, and are far larger than the tolerance


def model_state(seed: int) -> dict[str, torch.Tensor]:
    return build_tiny_lm(seed=seed).state_dict()


def test_zero3_loop_on_a_store_subscription_equals_plain_torch_steps(tmp_path) -> None:
    zero3_loop_from_store(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"torch {torch.__version__} sees no CUDA device")
def test_zero3_loop_on_cuda_equals_plain_torch_steps(tmp_path) -> None:
    """The same ZeRO-3 check where DeepSpeed's accelerator is CUDA (NCCL, GPU partitions)."""
    assert ds_device() == "cuda"
    zero3_loop_from_store(tmp_path)


class ExpiredItem(Item):
    """A micro-batch whose lease ended while it trained: its ack's answer is LeaseExpired."""

    def ack(self, wait: bool = True) -> Any:
        from concurrent.futures import Future

        from store.errors import LeaseExpired
        answer: Future = Future()
        answer.set_exception(LeaseExpired(f"the lease of {self.data.column('sample_id')[0].as_py()} "
                                          "ended before this ack"))
        return answer


def test_an_ack_that_fails_stops_the_step_with_the_weights_untouched(tmp_path) -> None:
    """Before, the loop stepped the engine and published the weights, then waited for the acks:
    the rows of an expired lease went to another consumer and were trained on here as well."""
    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config
    from store.errors import LeaseExpired

    model = build_tiny_lm(seed=6)
    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8, zero_stage=0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    before = copy.deepcopy(engine.module.state_dict())
    batch = items([make_global_batch(3)], [])
    batch[0] = ExpiredItem(batch[0].data, batch[0].index, batch[0].is_boundary)
    bumps: list[str] = []
    loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path / "weights")
    with pytest.raises(LeaseExpired, match="s3_0_0"):
        list(loop.run(batch, lambda *, weights_uri: bumps.append(weights_uri)))
    assert bumps == [] and loop.step == 0
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())


@contextlib.contextmanager
def store_via(via: str, tmp_path: Any) -> Iterator[Any]:
    """The embedded store on a DuckDB file, or a remote one through a Flight server over one."""
    import store
    from flight_fixtures import running_server

    with contextlib.ExitStack() as stack:
        if via == "embedded":
            yield stack.enter_context(store.connect(str(tmp_path / "x.duckdb")))
        else:
            server = stack.enter_context(running_server(tmp_path / "x.duckdb"))
            yield stack.enter_context(store.connect(server.location))


def run_in_thread(loop: Any, sub: Any, stop: Any) -> tuple[Any, list[Any], list[BaseException]]:
    """``loop.run(sub, sub.bump_version, stop=stop)`` on a thread: (thread, reports, errors)."""
    import threading

    reports: list[Any] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            reports.extend(loop.run(sub, sub.bump_version, stop=stop))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, reports, errors


STOP_COLUMNS = {"token_ids": "list<int32>", "logprobs": "list<float32>", "prompt_len": "int32",
                "reward": "float64", "advantage": "float32"}


@pytest.mark.parametrize("via", ["embedded", "flight"])
def test_stop_ends_a_loop_waiting_at_the_barrier(tmp_path, via: str) -> None:
    """Two agents share a version group; only the solver trains, so its bump waits at the
    barrier for a verifier that never arrives. Before, the loop had no stop: it waited for the
    group's barrier timeout (600 s)."""
    import threading

    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config
    from waiting import wait_until

    with store_via(via, tmp_path) as s:
        for agent in ("solver", "verifier"):
            s.create_table(agent, STOP_COLUMNS, version_group="team")
        s.put("solver", make_global_batch(5).drop_columns(["input_id"]))
        model = build_tiny_lm(seed=8)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()),
                                          config=deepspeed_config(micro_batch_size=4, global_batch_size=8))
        loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path / "weights")
        stop = threading.Event()
        with contextlib.closing(s.subscribe("solver", micro_batch_size=4, global_batch_size=8)) as sub:
            thread, reports, errors = run_in_thread(loop, sub, stop)
            try:
                wait_until(lambda: errors or s.barrier("solver")["arrived"] == ["solver"], timeout=60,
                           message="the solver's arrival at the barrier")
                assert errors == []
                stop.set()
                # (the barrier would hold it for its 600 s timeout; a stop takes about a second)
                thread.join(timeout=60)
                assert not thread.is_alive(), "stop did not end the bump waiting at the barrier"
            finally:
                stop.set()
                thread.join(timeout=30)
        assert errors == [] and reports == []
        # The step was taken on the whole global batch and its micro-batches acked; the version
        # did not move and the arrival stays, so the other agent still completes the round.
        assert loop.step == 1
        stats = s.stats("solver")["solver"]
        assert (stats["consumed"], stats["processing"]) == (8, 0)
        assert s.get_version("solver") == 0
        assert s.barrier("verifier")["arrived"] == ["solver"]
        assert s.arrive("verifier", expected=0) == 1


def test_stop_ends_a_loop_waiting_for_a_micro_batch_acking_nothing_untrained(tmp_path) -> None:
    """Half a global batch is ready and no more comes, and the subscription has no idle
    timeout: before, the loop waited for the next micro-batch for ever. With ``ack_at_step``
    the trained half stays unacked (no step used it), so closing the subscription gives it
    back."""
    import threading

    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config
    from waiting import wait_until

    with store_via("embedded", tmp_path) as s:
        s.create_table("solver", STOP_COLUMNS)
        s.put("solver", make_global_batch(5).drop_columns(["input_id"]).slice(0, 4))
        model = build_tiny_lm(seed=8)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()),
                                          config=deepspeed_config(micro_batch_size=4, global_batch_size=8))
        loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path / "weights",
                                  ack_at_step=True)
        stop = threading.Event()
        with contextlib.closing(s.subscribe("solver", micro_batch_size=4, global_batch_size=8)) as sub:
            thread, reports, errors = run_in_thread(loop, sub, stop)
            try:
                wait_until(lambda: errors or s.stats("solver")["solver"]["processing"] == 4, timeout=60,
                           message="the first micro-batch claimed")
                assert errors == []
                stop.set()
                # (with no idle timeout the wait would never end; a stop takes a poll)
                thread.join(timeout=60)
                assert not thread.is_alive(), "stop did not end the wait for a micro-batch"
            finally:
                stop.set()
                thread.join(timeout=30)
            assert errors == [] and reports == [] and loop.step == 0
            assert s.stats("solver")["solver"]["consumed"] == 0
        stats = s.stats("solver")["solver"]
        assert (stats["consumed"], stats["processing"], stats["ready"]) == (0, 0, 4)


def test_a_stop_that_the_bump_cannot_take_is_refused_before_training(tmp_path) -> None:
    import threading

    from consumers.deepspeed_loop import DeepSpeedTrainLoop, deepspeed_config

    model = build_tiny_lm(seed=6)
    cfg = deepspeed_config(micro_batch_size=4, global_batch_size=8, zero_stage=0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    log: list[str] = []
    loop = DeepSpeedTrainLoop(engine, lambda eng, b: grpo_loss(eng, b), tmp_path)
    with pytest.raises(TypeError, match="takes no 'stop' keyword"):
        list(loop.run(items([make_global_batch(3)], log), lambda *, weights_uri: 1,
                      stop=threading.Event()))
    assert log == [] and loop.step == 0
