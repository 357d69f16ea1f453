"""Rollout backends (tiny torch LM, vLLM) behind one interface, and weight publication helpers.

Only the interface is imported here; ``tiny_lm`` (torch) and ``vllm_backend`` (vLLM) are imported
on use, so code that only needs the types does not pay for torch.
"""
from __future__ import annotations

from producers.rollout.base import (
    FinishReason,
    Generation,
    PartialCallback,
    PartialGeneration,
    RolloutBackend,
    SamplingConfig,
)

__all__ = ["FinishReason", "Generation", "PartialCallback", "PartialGeneration", "RolloutBackend", "SamplingConfig"]
