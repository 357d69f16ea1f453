"""A tiny byte-level causal LM in plain torch, and the rollout backend that samples from it.

It stands in for a real policy where no weights can be downloaded (tests, the demo, CPU-only
machines): it is built in code from a seed, generates real tokens with real logprobs, trains with
the same collation and losses as a large model, and loads the weights a trainer publishes.

Example:
    >>> from producers.rollout.tiny_lm import TinyLMBackend
    >>> backend = TinyLMBackend(seed=0)
    >>> gens = backend.generate(["2+2="], n=2, max_new_tokens=5)
    >>> len(gens), len(gens[0].token_ids) == len(gens[0].logprobs)
    (2, True)
    >>> gens[0].finish_reason in ("stop", "length")
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from producers.rollout.base import (
    FinishReason,
    Generation,
    PartialCallback,
    PartialGeneration,
    RolloutBackend,
    SamplingConfig,
)
from producers.rollout.weights import load_state_dict

__all__ = ["ByteTokenizer", "TinyLMConfig", "TinyCausalLM", "TinyLMBackend", "build_tiny_lm"]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS (256) and EOS (257).

    Byte-level means every string round-trips and no vocabulary file is needed.
    """

    BOS = 256
    EOS = 257
    vocab_size = 258

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        # A sampled response can end mid-way through a multi-byte character; replace, don't fail.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = ByteTokenizer.vocab_size
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    max_seq_len: int = 256

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A pre-norm GPT with learned positions; ``forward`` returns logits ``[B, T, vocab]``.

    ``segment_ids`` (``[B, T]``, -1 for padding) makes attention block-diagonal, so packed rows
    (several sequences in one row, see :func:`consumers.torch_collate.collate`) give each sequence
    the same logits it would get alone, provided ``position_ids`` restart per sequence.
    """

    def __init__(self, config: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or TinyLMConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t = input_ids.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        allowed = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril().expand(b, t, t)
        if segment_ids is not None:
            allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
        # Right padding needs no key mask: a real token never attends to a later (padding) position.
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(self.ln_f(x))


def build_tiny_lm(seed: int = 0, config: TinyLMConfig | None = None) -> TinyCausalLM:
    """Build a :class:`TinyCausalLM` whose initial weights depend only on ``seed``.

    The global RNG is forked, so building a model does not disturb the caller's random stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyCausalLM(config)
    return model


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    # Drop a token when the mass before it already reaches top_p (the top token always survives).
    drop = (cum - sorted_logits.softmax(-1)) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class TinyLMBackend(RolloutBackend):
    """Rollout backend over a :class:`TinyCausalLM`, on the CPU or a CUDA device.

    The ``n`` samples of one prompt are generated as one batch; prompts run one after another (the
    model is tiny, the point is real tokens, not speed). Calls without ``SamplingConfig.seed`` draw
    from a generator seeded once with ``seed``, so successive calls differ but a run is repeatable
    (on one kind of device: CUDA draws a different stream from the same seed).

    ``device`` (default: where ``model``'s parameters are) is where generation runs; published
    weights, saved on the CPU, are copied onto it when loaded.

    Example:
        >>> import tempfile
        >>> from producers.rollout.weights import publish_state_dict
        >>> trainer_model = build_tiny_lm(seed=1)
        >>> uri = publish_state_dict(trainer_model.state_dict(), tempfile.mkdtemp(), step=1)
        >>> backend = TinyLMBackend(seed=0)
        >>> backend.load_weights(uri, policy_version=1)
        >>> backend.generate(["hi"], n=1, max_new_tokens=3)[0].policy_version
        1
    """

    def __init__(
        self,
        model: TinyCausalLM | None = None,
        *,
        seed: int = 0,
        tokenizer: ByteTokenizer | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        model = model if model is not None else build_tiny_lm(seed)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer or ByteTokenizer()
        self._rng = torch.Generator(self.device).manual_seed(seed)

    def _load_weights(self, uri: str) -> None:
        self.model.load_state_dict(load_state_dict(uri, map_location=self.device))

    @torch.inference_mode()
    def _generate(
        self,
        prompts: list[str],
        n: int,
        max_new_tokens: int,
        sampling: SamplingConfig,
        on_partial: PartialCallback | None,
    ) -> list[Generation]:
        rng = (torch.Generator(self.device).manual_seed(sampling.seed) if sampling.seed is not None
               else self._rng)
        dtype = next(self.model.parameters()).dtype
        out: list[Generation] = []
        for pi, prompt in enumerate(prompts):
            prompt_ids = self.tokenizer.encode(prompt)
            if len(prompt_ids) + max_new_tokens > self.model.config.max_seq_len:
                raise ValueError(
                    f"prompt {pi} has {len(prompt_ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                    f"the model's max_seq_len {self.model.config.max_seq_len}"
                )
            seq = torch.tensor(prompt_ids, device=self.device).expand(n, -1).clone()
            tokens: list[list[int]] = [[] for _ in range(n)]
            logps: list[list[float]] = [[] for _ in range(n)]
            done = [False] * n
            for step in range(max_new_tokens):
                logits = self.model(seq)[:, -1].to(torch.float64 if dtype == torch.float64 else torch.float32)
                # Logprobs of the unscaled distribution: what the trainer recomputes (see SamplingConfig).
                logp = logits.log_softmax(-1)
                if sampling.temperature == 0:
                    nxt = logits.argmax(-1)
                else:
                    probs = _top_p_filter(logits / sampling.temperature, sampling.top_p).softmax(-1)
                    nxt = torch.multinomial(probs, 1, generator=rng).squeeze(-1)
                # One copy to the host per step, not one per sample (each is a sync on a GPU).
                step_tokens = nxt.tolist()
                step_logps = logp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
                for i in range(n):
                    if done[i]:
                        continue
                    tok = step_tokens[i]
                    tokens[i].append(tok)
                    logps[i].append(step_logps[i])
                    done[i] = tok == ByteTokenizer.EOS
                    if on_partial is not None:
                        # One call per token; the last one (EOS or the length limit) says finished.
                        finished = done[i] or step == max_new_tokens - 1
                        on_partial(PartialGeneration(pi, i, self.tokenizer.decode(tokens[i]), list(tokens[i]), finished))
                if all(done):
                    break
                seq = torch.cat([seq, nxt[:, None]], dim=1)
            for i in range(n):
                reason: FinishReason = "stop" if done[i] else "length"
                out.append(Generation(pi, i, prompt, self.tokenizer.decode(tokens[i]), list(prompt_ids),
                                      tokens[i], logps[i], reason))
        return out
