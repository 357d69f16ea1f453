"""Turn a micro-batch (an Arrow table of samples) into padded or packed torch tensors.

Layout conventions (all ``[R, L]`` tensors are *token-aligned*):

* ``input_ids[r, t]`` is a token; ``segment_ids[r, t]`` is the index (row of the input table) of
  the sample it belongs to, or -1 for padding. Padded layout: one sample per row (``R = B``).
  Packed layout (``pack_length=...``): several samples per row, ``position_ids`` restarting at 0
  for each, so a model that honours ``segment_ids`` (block-diagonal attention) sees each sample as
  if it were alone.
* ``loss_mask[r, t]`` is True when token ``t`` is a training target: a response token, never a
  prompt token and never the first token of a sample (nothing predicts it). With a ``loss_mask``
  column (multi-turn: tool output masked out) that column decides, still minus the first token.
* ``old_logprobs[r, t]`` is the rollout policy's logprob of token ``t`` (0 where unknown). The
  ``logprobs`` column may cover the whole sequence or only the response (``len == len(token_ids) -
  prompt_len``); both are placed at their tokens.
* Per-sample values (``rewards``, ``group_ids``, ``advantages``) are ``[B]`` in table order;
  :meth:`TorchBatch.per_token` spreads one onto the token layout.

GRPO advantages are normalised within each ``input_id`` group *of this micro-batch*. That is only
right when groups are whole: claim with ``group_by="input_id", group_size=G`` and pass
``group_size=G`` here to have a split group rejected instead of silently mis-normalised.

Example:
    >>> import pyarrow as pa
    >>> t = pa.table({"token_ids": [[256, 1, 2, 3], [256, 4, 5]], "prompt_len": [2, 2],
    ...               "reward": [1.0, 0.0], "input_id": ["q1", "q1"]})
    >>> b = collate(t)
    >>> b.input_ids.tolist()
    [[256, 1, 2, 3], [256, 4, 5, 0]]
    >>> b.loss_mask.int().tolist()
    [[0, 0, 1, 1], [0, 0, 1, 0]]
    >>> [round(a, 3) for a in b.advantages.tolist()]
    [0.707, -0.707]
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import pyarrow as pa
import torch

from consumers.grpo import group_advantages
from store.halves import bfloat16_floats, is_bfloat16

__all__ = ["Columns", "TorchBatch", "arrow_to_torch", "collate", "pack_first_fit",
           "tensor_column"]


@dataclass(frozen=True)
class Columns:
    """Which table columns the collator reads. A column set to None, or absent, is skipped."""

    token_ids: str = "token_ids"
    prompt_len: str | None = "prompt_len"
    loss_mask: str | None = "loss_mask"
    logprobs: str | None = "logprobs"
    reward: str | None = "reward"
    group: str | None = "input_id"
    #: A precomputed advantage column (e.g. from SQL) wins over computing one from rewards.
    advantage: str | None = "advantage"
    sample_id: str = "sample_id"


@dataclass
class TorchBatch:
    """A collated micro-batch; see the module docstring for the layout."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    loss_mask: torch.Tensor
    sample_lengths: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    #: Tensor columns: stacked when all shapes agree, else a list.
    extras: dict[str, torch.Tensor | list[torch.Tensor]] = field(default_factory=dict)
    group_keys: list[str] = field(default_factory=list)
    packed: bool = False

    @property
    def num_samples(self) -> int:
        return int(self.sample_lengths.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """Spread a per-sample ``[B]`` tensor onto the ``[R, L]`` token layout (0 at padding)."""
        if values.shape != (self.num_samples,):
            raise ValueError(f"expected a [{self.num_samples}] tensor, got {tuple(values.shape)}")
        idx = self.segment_ids.clamp(min=0)
        return torch.where(self.segment_ids >= 0, values[idx], torch.zeros((), dtype=values.dtype, device=values.device))

    def to(self, device: torch.device | str) -> TorchBatch:
        """A copy with every tensor moved to ``device``."""
        moved: dict[str, object] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                moved[f.name] = v.to(device)
            elif f.name == "extras":
                moved[f.name] = {k: (x.to(device) if isinstance(x, torch.Tensor) else [y.to(device) for y in x])
                                 for k, x in v.items()}
        return replace(self, **moved)  # type: ignore[arg-type]


def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _sample_name(table: pa.Table, cols: Columns, i: int) -> str:
    if cols.sample_id in table.column_names:
        return f"sample {table.column(cols.sample_id)[i].as_py()!r}"
    return f"row {i}"


def _list_column(table: pa.Table, name: str, cols: Columns) -> tuple[np.ndarray, np.ndarray]:
    """Return (flat values, per-row lengths) of a list column; a null list is an error."""
    arr = _column(table, name)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise TypeError(f"column {name!r} has type {arr.type}; expected list<...> or large_list<...>")
    if arr.null_count:
        i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {name!r} is null for {_sample_name(table, cols, i)}; every sample needs a value")
    lengths = arr.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    return _numbers(arr.flatten()), lengths


def _numbers(arr: pa.Array) -> np.ndarray:
    """A flat column's values as numpy (bfloat16, which numpy lacks, as float32: exact)."""
    return bfloat16_floats(arr) if is_bfloat16(arr.type) else arr.to_numpy(zero_copy_only=False)


def _scalar_column(table: pa.Table, name: str, cols: Columns) -> np.ndarray:
    arr = _column(table, name)
    if arr.null_count:
        i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {name!r} is null for {_sample_name(table, cols, i)}; every sample needs a value")
    return _numbers(arr)


def pack_first_fit(lengths: Sequence[int], pack_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign sequences to rows of ``pack_length`` tokens, first fit in table order.

    Returns ``(row, offset)`` per sequence. Order-preserving first fit keeps the result
    deterministic for a given micro-batch (claims are deterministically ordered too).
    """
    free: list[int] = []
    rows = np.empty(len(lengths), np.int64)
    offsets = np.empty(len(lengths), np.int64)
    for i, n in enumerate(lengths):
        if n > pack_length:
            raise ValueError(f"sequence {i} has {n} tokens, more than pack_length={pack_length}")
        for r, room in enumerate(free):
            if room >= n:
                break
        else:
            r = len(free)
            free.append(pack_length)
        rows[i], offsets[i] = r, pack_length - free[r]
        free[r] -= n
    return rows, offsets


def arrow_to_torch(values: pa.Array | pa.ChunkedArray, *, copy: bool = True) -> torch.Tensor:
    """A flat Arrow array of numbers without nulls as a 1-D tensor of the matching dtype, bit
    for bit: ``float16`` gives ``torch.float16``, ``bfloat16`` (the store's
    ``expstore.bfloat16``, see :mod:`store.halves`) ``torch.bfloat16``.

    Args:
        copy: False shares the Arrow buffer (zero-copy, through DLPack) where its layout
            allows: the tensor must then not be written to, as the buffer may be the store's
            own (its cache of claimable values, in an embedded store).

    Raises:
        ValueError: the array has nulls (a tensor has no null).
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if values.null_count:
        raise ValueError(f"an array of {values.type} with {values.null_count} nulls has no "
                         "tensor form; expected no nulls")
    bfloat16 = is_bfloat16(values.type)
    if bfloat16:
        values = values.storage
    try:
        tensor = torch.from_dlpack(values)
    except (TypeError, BufferError, RuntimeError, NotImplementedError):  # e.g. bool (bit-packed)
        tensor = torch.from_numpy(values.to_numpy(zero_copy_only=False).copy())
        copy = False
    if bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.clone() if copy else tensor


def tensor_column(column: pa.Array | pa.ChunkedArray) -> torch.Tensor | list[torch.Tensor]:
    """A tensor column (``struct<shape, data>``) as torch tensors of its element type (float16
    and bfloat16 included, bit for bit): one stacked ``[B, *shape]`` tensor when every shape
    agrees, else a list. One copy (the tensors are the caller's to write to).

    Raises:
        ValueError: a null tensor.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise ValueError("the tensor column has a null value")
    shapes = column.field("shape").to_pylist()
    datas = column.field("data")
    flat = arrow_to_torch(datas.flatten(), copy=False)
    if shapes and all(shape == shapes[0] for shape in shapes):
        return flat.reshape(len(shapes), *shapes[0]).clone()
    offsets = datas.offsets.to_numpy()
    base = int(offsets[0])
    return [flat[int(a) - base:int(b) - base].reshape(shape).clone()
            for a, b, shape in zip(offsets[:-1], offsets[1:], shapes)]


def _tensor_columns(table: pa.Table, names: Sequence[str] | None) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    candidates = names if names is not None else table.column_names
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name in candidates:
        t = table.schema.field(name).type
        is_tensor = pa.types.is_struct(t) and [t.field(i).name for i in range(t.num_fields)] == ["shape", "data"]
        if not is_tensor:
            if names is not None:
                raise TypeError(f"column {name!r} has type {t}; expected a tensor column struct<shape, data>")
            continue
        try:
            out[name] = tensor_column(table.column(name))
        except ValueError:
            raise ValueError(f"tensor column {name!r} has a null value") from None
    return out


def collate(
    table: pa.Table | pa.RecordBatch,
    *,
    columns: Columns | None = None,
    pad_id: int = 0,
    pack_length: int | None = None,
    group_size: int | None = None,
    scale_advantages_by_std: bool = True,
    tensor_columns: Sequence[str] | None = None,
    float_dtype: torch.dtype = torch.float32,
) -> TorchBatch:
    """Collate a micro-batch table into a :class:`TorchBatch`.

    Args:
        table: one micro-batch (``MicroBatch.data``).
        columns: column names to read (defaults: ``token_ids``, ``prompt_len``, ``loss_mask``,
            ``logprobs``, ``reward``, ``input_id``, ``advantage``).
        pad_id: token id written at padding positions (masked out everywhere).
        pack_length: pack samples into rows of this many tokens instead of one padded row each.
        group_size: if given, every ``input_id`` group must have exactly this many samples.
        scale_advantages_by_std: GRPO (True) or Dr. GRPO (False) advantages.
        tensor_columns: tensor columns to convert (default: every ``struct<shape, data>`` column).
        float_dtype: dtype of logprobs, rewards and advantages.

    Raises:
        ValueError: a null or inconsistent value; the message names the sample and the column.
        TypeError: a column has the wrong Arrow type.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    cols = columns or Columns()
    names = set(table.column_names)
    if cols.token_ids not in names:
        raise ValueError(f"micro-batch has no column {cols.token_ids!r}; columns are {sorted(names)}")
    flat_tokens, lengths = _list_column(table, cols.token_ids, cols)
    b = len(lengths)
    if b and lengths.min() == 0:
        i = int(np.argmin(lengths))
        raise ValueError(f"column {cols.token_ids!r} is empty for {_sample_name(table, cols, i)}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if b else np.zeros(0, np.int64)
    total = int(lengths.sum())
    pos = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)  # position within its sample
    sample_of_token = np.repeat(np.arange(b, dtype=np.int64), lengths)

    # Token-aligned loss mask; position 0 of every sample is never a target.
    prompt_len = np.ones(b, np.int64)
    if cols.prompt_len and cols.prompt_len in names:
        prompt_len = _scalar_column(table, cols.prompt_len, cols).astype(np.int64)
        bad = np.flatnonzero((prompt_len < 0) | (prompt_len > lengths))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{cols.prompt_len!r} is {prompt_len[i]} for {_sample_name(table, cols, i)}, "
                             f"expected 0..{lengths[i]} (its number of tokens)")
    if cols.loss_mask and cols.loss_mask in names:
        flat_mask, mask_lengths = _list_column(table, cols.loss_mask, cols)
        bad = np.flatnonzero(mask_lengths != lengths)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{cols.loss_mask!r} has {mask_lengths[i]} entries for {_sample_name(table, cols, i)}, "
                             f"expected {lengths[i]} (one per token)")
        flat_loss = flat_mask.astype(bool) & (pos >= 1)
    else:
        flat_loss = pos >= np.maximum(np.repeat(prompt_len, lengths), 1)

    flat_logprobs: np.ndarray | None = None
    if cols.logprobs and cols.logprobs in names:
        lp_values, lp_lengths = _list_column(table, cols.logprobs, cols)
        full = lp_lengths == lengths
        response_only = lp_lengths == lengths - prompt_len
        bad = np.flatnonzero(~(full | response_only))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{cols.logprobs!r} has {lp_lengths[i]} entries for {_sample_name(table, cols, i)}; "
                             f"expected {lengths[i]} (every token) or {lengths[i] - prompt_len[i]} (response only)")
        shift = np.where(full, 0, prompt_len)
        lp_starts = np.cumsum(lp_lengths) - lp_lengths  # (no rows: none)
        dest = np.repeat(starts + shift, lp_lengths) + (np.arange(int(lp_lengths.sum())) - np.repeat(lp_starts, lp_lengths))
        flat_logprobs = np.zeros(total, np.float64)
        flat_logprobs[dest] = lp_values

    if pack_length is not None:
        rows, offsets = pack_first_fit(lengths.tolist(), pack_length)
        n_rows, width = (int(rows.max()) + 1 if b else 0), pack_length
    else:
        rows, offsets = np.arange(b, dtype=np.int64), np.zeros(b, np.int64)
        n_rows, width = b, (int(lengths.max()) if b else 0)
    r_idx = np.repeat(rows, lengths)
    c_idx = np.repeat(offsets, lengths) + pos

    def scatter(values: np.ndarray, fill: float | int, dtype: np.dtype) -> torch.Tensor:
        grid = np.full((n_rows, width), fill, dtype=dtype)
        grid[r_idx, c_idx] = values
        return torch.from_numpy(grid)

    batch = TorchBatch(
        input_ids=scatter(flat_tokens, pad_id, np.dtype(np.int64)),
        attention_mask=scatter(np.ones(total, bool), False, np.dtype(bool)),
        position_ids=scatter(pos, 0, np.dtype(np.int64)),
        segment_ids=scatter(sample_of_token, -1, np.dtype(np.int64)),
        loss_mask=scatter(flat_loss, False, np.dtype(bool)),
        sample_lengths=torch.from_numpy(lengths),
        packed=pack_length is not None,
    )
    if flat_logprobs is not None:
        batch.old_logprobs = scatter(flat_logprobs, 0.0, np.dtype(np.float64)).to(float_dtype)

    if cols.reward and cols.reward in names:
        batch.rewards = torch.from_numpy(_scalar_column(table, cols.reward, cols).astype(np.float64)).to(float_dtype)
    if cols.group and cols.group in names:
        encoded = _column(table, cols.group).dictionary_encode()  # codes in order of first appearance
        if encoded.null_count:
            raise ValueError(f"column {cols.group!r} has a null; every sample needs a group")
        codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        batch.group_ids = torch.from_numpy(codes)
        batch.group_keys = [str(k) for k in encoded.dictionary.to_pylist()]
        if group_size is not None:
            counts = np.bincount(codes, minlength=len(batch.group_keys))
            bad = np.flatnonzero(counts != group_size)
            if bad.size:
                g = int(bad[0])
                raise ValueError(
                    f"group {batch.group_keys[g]!r} has {counts[g]} samples in this micro-batch, expected "
                    f"group_size={group_size}; claim with group_by={cols.group!r} so groups are not split")
    if cols.advantage and cols.advantage in names:
        batch.advantages = torch.from_numpy(_scalar_column(table, cols.advantage, cols).astype(np.float64)).to(float_dtype)
    elif batch.rewards is not None and batch.group_ids is not None:
        batch.advantages = group_advantages(batch.rewards, batch.group_ids, scale_by_std=scale_advantages_by_std)
    batch.extras = _tensor_columns(table, tensor_columns)
    return batch
