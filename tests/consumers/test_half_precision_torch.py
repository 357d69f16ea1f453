"""A claim's float16 and bfloat16 columns as torch tensors: the right dtype, bit for bit, from
an embedded store and from a remote one (through a real Flight server); without a copy where
asked for."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from consumers.torch_collate import arrow_to_torch, collate, tensor_column
from store.halves import BFLOAT16

# NaNs with payloads (both signs), infinity, subnormals, -0, 1, -0.5
BF16_BITS = np.array([0x7F81, 0xFFC1, 0x7F80, 0x0001, 0x8001, 0x8000, 0x3F80, 0xBF00],
                     np.uint16)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).tolist()


def test_a_micro_batch_collates_to_half_precision_tensors(any_store):
    """Through a subscription (remote: the server's exchange stream)."""
    any_store.create_table("t", {"token_ids": "list<int32>", "logprobs": "list<bfloat16>",
                                 "reward": "float16", "hidden": "tensor<bfloat16>",
                                 "values": "tensor<float16>"})
    hidden = _bf16(BF16_BITS).reshape(2, 4)
    values = torch.tensor([0.5, -1.25, 65504.0], dtype=torch.float16)
    logprobs = torch.tensor([-0.5, -1.5, -0.25], dtype=torch.bfloat16)
    any_store.put("t", {"sample_id": ["q1_0_0", "q1_0_1"],
                        "token_ids": [[1, 2, 3], [4, 5, 6]],
                        "logprobs": [logprobs, logprobs],
                        "reward": np.array([1.0, 0.0], np.float16),
                        "hidden": [hidden, hidden], "values": [values, values]})
    sub = any_store.subscribe("t", micro_batch_size=2, global_batch_size=2)
    mb = sub.next(timeout=20)
    assert mb is not None, "no micro-batch within 20 s"
    batch = collate(mb.data, columns=None, float_dtype=torch.bfloat16)
    assert batch.extras["hidden"].dtype == torch.bfloat16
    assert batch.extras["hidden"].shape == (2, 2, 4)
    assert _bits(batch.extras["hidden"]) == BF16_BITS.tolist() * 2
    assert batch.extras["values"].dtype == torch.float16
    assert batch.extras["values"].tolist() == [[0.5, -1.25, 65504.0]] * 2
    # logprobs decoded from their bfloat16 patterns (not read as the integers they are stored as)
    assert batch.old_logprobs.dtype == torch.bfloat16
    assert _bits(batch.old_logprobs) == _bits(logprobs) * 2
    assert batch.rewards.tolist() == [1.0, 0.0]
    mb.ack()
    sub.close()


def test_arrow_to_torch_shares_the_buffer_when_asked():
    bits = pa.ExtensionArray.from_storage(BFLOAT16, pa.array(BF16_BITS))
    shared = arrow_to_torch(bits, copy=False)
    assert shared.dtype == torch.bfloat16 and _bits(shared) == BF16_BITS.tolist()
    assert shared.data_ptr() == bits.storage.buffers()[1].address
    copied = arrow_to_torch(bits)
    assert copied.data_ptr() != bits.storage.buffers()[1].address
    half = pa.array(np.array([1.5, -2.0], np.float16))
    assert arrow_to_torch(half, copy=False).dtype == torch.float16
    assert arrow_to_torch(half.slice(1), copy=False).tolist() == [-2.0]
    with pytest.raises(ValueError, match="nulls"):
        arrow_to_torch(pa.array([1.0, None], pa.float16()))


def test_tensor_column_of_mixed_shapes_is_a_list():
    from store.tensors import to_arrow
    column = to_arrow([_bf16(BF16_BITS[:4]).reshape(2, 2), _bf16(BF16_BITS[4:7])],
                      dtype=BFLOAT16)
    got = tensor_column(column.slice(0))
    assert isinstance(got, list) and [t.shape for t in got] == [(2, 2), (3,)]
    assert _bits(got[0]) + _bits(got[1]) == BF16_BITS[:7].tolist()
    assert tensor_column(column.slice(1))[0].dtype == torch.bfloat16


def test_numpy_has_no_bfloat16_and_says_where_to_go():
    from store.tensors import to_arrow, to_numpy
    with pytest.raises(TypeError, match="tensor_column"):
        to_numpy(to_arrow([_bf16(BF16_BITS)], dtype=BFLOAT16))
    assert to_numpy(to_arrow([np.ones(2, np.float16)]))[0].dtype == np.float16
