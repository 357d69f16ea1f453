"""The rollout backend interface shared by the tiny torch LM and vLLM.

A backend turns prompts into :class:`Generation` records (text, token ids, per-token logprobs and
a finish reason) and can swap in published weights with :meth:`RolloutBackend.load_weights`. Every
generation is tagged with the weights it came from (``weights_uri`` and ``policy_version``), so a
rollout driver can write samples with the right ``policy_version`` even while the trainer publishes
new weights concurrently.

Concurrency contract (what a driver may rely on):

* :meth:`RolloutBackend.generate` and :meth:`RolloutBackend.load_weights` may be called from any
  thread. The base class serialises them with one lock, so a weight swap never lands in the middle
  of a generation and every :class:`Generation` names exactly one policy.
* :meth:`RolloutBackend.agenerate` / :meth:`RolloutBackend.aload_weights` run the blocking calls in
  a worker thread for asyncio drivers; the event loop is never blocked.
* ``on_partial`` callbacks run on the generating thread; they must be quick and must not call back
  into the backend (the lock is held).
"""
from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FinishReason", "Generation", "PartialGeneration", "PartialCallback", "SamplingConfig", "RolloutBackend"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings for one :meth:`RolloutBackend.generate` call.

    ``temperature`` and ``top_p`` shape sampling only: the reported logprobs are always those of the
    model's unscaled distribution (temperature 1), the quantity a trainer recomputes for its
    importance ratios. ``seed`` makes a call reproducible on the same backend and weights.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    ``token_ids`` and ``logprobs`` cover the response only (an end-of-sequence token, when sampled,
    is included: the policy chose it, so it is trained on); ``prompt_token_ids`` is the tokenised
    prompt, so ``prompt_token_ids + token_ids`` is the full sequence and ``len(prompt_token_ids)`` is
    the ``prompt_len`` the collator masks out of the loss.
    """

    prompt_index: int
    sample_index: int
    prompt: str
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weights_uri: str | None = None
    policy_version: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def full_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.token_ids


@dataclass(frozen=True)
class PartialGeneration:
    """A response still being generated, passed to ``on_partial`` as tokens arrive.

    A driver can upsert it with ``response_status = false`` so SQL sees live responses; the final
    :class:`Generation` follows with ``finished=True`` semantics.
    """

    prompt_index: int
    sample_index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


PartialCallback = Callable[[PartialGeneration], None]


class RolloutBackend(ABC):
    """Base class of rollout backends: locking, weight tagging and asyncio wrappers.

    Subclasses implement :meth:`_generate` and :meth:`_load_weights`; callers use the public
    methods. See :class:`producers.rollout.tiny_lm.TinyLMBackend` for a worked example.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._weights_uri: str | None = None
        self._policy_version: int | None = None

    @property
    def weights_uri(self) -> str | None:
        """The URI of the weights currently loaded (None: the initial weights)."""
        return self._weights_uri

    @property
    def policy_version(self) -> int | None:
        """The policy version the current weights belong to, as given to :meth:`load_weights`."""
        return self._policy_version

    def generate(
        self,
        prompts: Sequence[str],
        n: int = 1,
        max_new_tokens: int = 64,
        *,
        sampling: SamplingConfig | None = None,
        on_partial: PartialCallback | None = None,
    ) -> list[Generation]:
        """Sample ``n`` responses for each prompt.

        Returns:
            ``len(prompts) * n`` generations ordered by prompt, then sample index.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of strings, not one string")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        with self._lock:
            gens = self._generate(list(prompts), n, max_new_tokens, sampling or SamplingConfig(), on_partial)
            uri, version = self._weights_uri, self._policy_version
        return [
            Generation(
                prompt_index=g.prompt_index, sample_index=g.sample_index, prompt=g.prompt, text=g.text,
                prompt_token_ids=g.prompt_token_ids, token_ids=g.token_ids, logprobs=g.logprobs,
                finish_reason=g.finish_reason, weights_uri=uri, policy_version=version,
            )
            for g in gens
        ]

    def load_weights(self, uri: str, policy_version: int | None = None) -> None:
        """Load published weights; later generations are tagged with ``uri`` and ``policy_version``."""
        with self._lock:
            self._load_weights(uri)
            self._weights_uri, self._policy_version = uri, policy_version

    async def agenerate(
        self,
        prompts: Sequence[str],
        n: int = 1,
        max_new_tokens: int = 64,
        *,
        sampling: SamplingConfig | None = None,
        on_partial: PartialCallback | None = None,
    ) -> list[Generation]:
        """:meth:`generate` in a worker thread, for asyncio drivers."""
        return await asyncio.to_thread(
            self.generate, prompts, n, max_new_tokens, sampling=sampling, on_partial=on_partial
        )

    async def aload_weights(self, uri: str, policy_version: int | None = None) -> None:
        """:meth:`load_weights` in a worker thread, for asyncio drivers."""
        await asyncio.to_thread(self.load_weights, uri, policy_version)

    def close(self) -> None:
        """Release the backend's resources (engines, worker processes). Idempotent."""

    def __enter__(self) -> RolloutBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _generate(
        self,
        prompts: list[str],
        n: int,
        max_new_tokens: int,
        sampling: SamplingConfig,
        on_partial: PartialCallback | None,
    ) -> list[Generation]:
        """Generate under the lock; tags (weights_uri, policy_version) are filled in by the caller."""

    @abstractmethod
    def _load_weights(self, uri: str) -> None:
        """Load weights under the lock."""
