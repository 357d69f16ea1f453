"""A rollout's bfloat16 and float16 torch tensors written row by row through the buffered
writer (0-d for a value, 1-d for a list, any shape for a tensor) come back bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from producers import ExperienceWriter
from store.errors import SchemaMismatch


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).tolist()


def test_rows_of_torch_tensors(any_store):
    any_store.create_table("t", {"value": "bfloat16", "logprobs": "list<bfloat16>",
                                 "hidden": "tensor<bfloat16>", "adv": "float16"})
    gen = torch.Generator().manual_seed(0)
    rows = [{"sample_id": f"q{i}_0_0", "value": torch.randn((), generator=gen).bfloat16(),
             "logprobs": torch.randn(3 + i, generator=gen).bfloat16(),
             "hidden": torch.randn(2, 3, generator=gen).bfloat16(),
             "adv": torch.randn((), generator=gen).half()} for i in range(5)]
    with ExperienceWriter(any_store, "t", batch_rows=2) as writer:
        for row in rows:
            writer.write(row)
    data = any_store.claim("t", 5).data.sort_by("sample_id")
    value = data.column("value").combine_chunks().storage.to_pylist()
    assert value == [_bits(r["value"])[0] for r in rows]
    flat = data.column("logprobs").combine_chunks().flatten().storage.to_pylist()
    assert flat == sum((_bits(r["logprobs"]) for r in rows), [])
    hidden = data.column("hidden").combine_chunks().field("data").flatten().storage.to_pylist()
    assert hidden == sum((_bits(r["hidden"]) for r in rows), [])
    assert data.column("adv").to_pylist() == [r["adv"].item() for r in rows]


def test_a_row_of_the_wrong_dtype_is_refused_by_name(embedded_store):
    embedded_store.create_table("t", {"value": "bfloat16"})
    with pytest.raises(SchemaMismatch, match=r"'value'.*float32.*bfloat16"):
        embedded_store.put("t", [{"sample_id": "q_0_0", "value": torch.tensor(0.5)}])
    with pytest.raises(SchemaMismatch, match=r"'value'.*shape \[2\].*one value per row"):
        embedded_store.put("t", [{"sample_id": "q_0_0", "value": torch.ones(2).bfloat16()}])
