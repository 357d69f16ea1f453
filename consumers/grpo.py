"""GRPO pieces: group-normalised advantages, token logprobs and the clipped policy loss.

Losses here return ``(loss_sum, count)`` rather than a mean, because the right denominator of a
micro-batch's loss is the *global* batch's count, which only
:class:`consumers.accumulation.GradientAccumulator` knows (see that module).

Example:
    >>> import torch
    >>> adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    >>> [round(a, 3) for a in adv.tolist()]
    [0.707, -0.707, 0.0, 0.0]
"""
from __future__ import annotations

import torch

__all__ = ["group_advantages", "token_logprobs", "clipped_policy_loss"]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale_by_std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``(r - mean_g) / (std_g + eps)`` per sample, with mean and std over the sample's group.

    Args:
        rewards: ``[B]`` rewards.
        group_ids: ``[B]`` integer group of each sample (samples of one prompt share a group).
        scale_by_std: divide by the group's std (GRPO); False keeps ``r - mean_g`` (Dr. GRPO).
        unbiased: Bessel-corrected std, as ``Tensor.std`` and TRL's GRPO use.
        eps: keeps groups whose rewards are all equal at advantage 0 instead of NaN.

    A group of one sample has no spread: its advantage is 0. The result is only the GRPO advantage
    if every group is complete in this batch; claim with ``group_by="input_id"`` so groups are never
    split across micro-batches.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D shapes")
    r = rewards.to(torch.float64)
    ids = group_ids.long()
    n_groups = int(ids.max()) + 1 if ids.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, ids, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, ids, r) / count
    centred = r - mean[ids]
    if not scale_by_std:
        return centred.to(rewards.dtype)
    sq = torch.zeros_like(count).index_add_(0, ids, centred * centred)
    denom = (count - 1).clamp(min=1) if unbiased else count
    std = (sq / denom).sqrt()
    return (centred / (std[ids] + eps)).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``; ``out[:, 0] = 0``.

    Token-aligned like the collator's ``loss_mask`` and ``old_logprobs``: position ``t`` holds the
    logprob of the token *at* ``t``. The first token of a row (and, in packed rows, of each packed
    sequence) has no prediction; the collator's ``loss_mask`` is False there.
    """
    logp = logits[:, :-1].float().log_softmax(-1) if logits.dtype in (torch.float16, torch.bfloat16) \
        else logits[:, :-1].log_softmax(-1)
    picked = logp.gather(-1, input_ids[:, 1:, None].long()).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO clipped surrogate, summed over the loss tokens.

    Args:
        logprobs: ``[R, L]`` current policy's token logprobs (:func:`token_logprobs`).
        old_logprobs: ``[R, L]`` the rollout policy's logprobs (the collator's ``old_logprobs``).
        advantages: ``[R, L]`` per-token advantages (``batch.per_token(batch.advantages)``).
        loss_mask: ``[R, L]`` bool, the tokens to train on.

    Returns:
        ``(loss_sum, n_tokens)``: the summed per-token loss and the number of loss tokens. Pass both
        to :meth:`consumers.accumulation.GradientAccumulator.backward` for a token-mean loss.
    """
    mask = loss_mask.to(logprobs.dtype)
    ratio = (logprobs - old_logprobs.to(logprobs.dtype)).exp()
    adv = advantages.to(logprobs.dtype)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return (per_token * mask).sum(), loss_mask.sum()
