"""Rollout-side clients: the buffered :class:`ExperienceWriter` and rollout drivers.

The rollout backends (a vLLM one and a tiny torch LM for CPU-only machines) live in
:mod:`producers.rollout` and import torch or vllm only when used.
"""
from __future__ import annotations

from .writer import ExperienceWriter

__all__ = ["ExperienceWriter"]
