"""Collation of Arrow micro-batches into torch tensors (consumers.torch_collate)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.grpo import group_advantages, token_logprobs  # noqa: E402
from consumers.torch_collate import Columns, collate, pack_first_fit  # noqa: E402
from producers.rollout.tiny_lm import build_tiny_lm  # noqa: E402


def _table(large: bool = False) -> pa.Table:
    lt = pa.large_list if large else pa.list_
    return pa.table({
        "sample_id": ["a_0_0", "a_0_1", "b_0_0", "b_0_1"],
        "input_id": ["a", "a", "b", "b"],
        "token_ids": pa.array([[256, 10, 11, 12, 13], [256, 10, 20], [256, 30, 31, 32], [256, 30, 40, 41, 42, 43]],
                              lt(pa.int32())),
        "prompt_len": pa.array([2, 2, 3, 3], pa.int32()),
        # response-only logprobs for the first three, full-length for the last
        "logprobs": pa.array([[-1.0, -2.0, -3.0], [-4.0], [-5.0], [0.0, 0.0, 0.0, -6.0, -7.0, -8.0]], lt(pa.float32())),
        "reward": pa.array([1.0, 0.0, 0.5, 0.5], pa.float64()),
    })


@pytest.mark.parametrize("large", [False, True])
def test_padded_layout(large: bool) -> None:
    b = collate(_table(large), pad_id=-1)
    assert b.input_ids.tolist() == [
        [256, 10, 11, 12, 13, -1], [256, 10, 20, -1, -1, -1], [256, 30, 31, 32, -1, -1], [256, 30, 40, 41, 42, 43]]
    assert b.attention_mask.sum(1).tolist() == [5, 3, 4, 6]
    assert b.loss_mask.int().tolist() == [
        [0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert b.num_loss_tokens == 3 + 1 + 1 + 3
    assert b.position_ids[3].tolist() == list(range(6))
    assert b.segment_ids[1].tolist() == [1, 1, 1, -1, -1, -1]
    assert b.old_logprobs is not None
    assert b.old_logprobs[0].tolist() == [0, 0, -1, -2, -3, 0]
    assert b.old_logprobs[2].tolist() == [0, 0, 0, -5, 0, 0]
    assert b.old_logprobs[3].tolist() == [0, 0, 0, -6, -7, -8]
    assert not b.packed and b.num_samples == 4


@pytest.mark.parametrize("pack_length", [None, 8])
def test_a_micro_batch_of_no_rows_collates_to_empty_tensors(pack_length) -> None:
    """A claim that found nothing ready has no rows; its table has every column. It collates
    to tensors of no samples (it raised a numpy broadcast error where logprobs were present)."""
    b = collate(_table().slice(0, 0), pack_length=pack_length)
    assert b.num_samples == 0 and b.num_loss_tokens == 0
    assert b.input_ids.shape == (0, pack_length or 0)
    assert b.old_logprobs is not None and b.old_logprobs.shape == b.input_ids.shape
    assert b.rewards is not None and b.rewards.shape == (0,)


def test_groups_and_advantages() -> None:
    t = pa.table({"token_ids": [[1, 2]] * 5, "input_id": ["q2", "q1", "q2", "q1", "q2"],
                  "reward": [1.0, 3.0, 2.0, 5.0, 6.0]})
    b = collate(t, float_dtype=torch.float64)
    assert b.group_ids is not None and b.group_ids.tolist() == [0, 1, 0, 1, 0]
    assert b.group_keys == ["q2", "q1"]
    r = np.array([1.0, 3.0, 2.0, 5.0, 6.0])
    expected = np.empty(5)
    for g in (np.array([0, 2, 4]), np.array([1, 3])):
        expected[g] = (r[g] - r[g].mean()) / (r[g].std(ddof=1) + 1e-6)
    assert b.advantages is not None
    np.testing.assert_allclose(b.advantages.numpy(), expected, rtol=1e-12)
    dr = collate(t, float_dtype=torch.float64, scale_advantages_by_std=False).advantages
    assert dr is not None
    np.testing.assert_allclose(dr.numpy(), [1 - 3, 3 - 4, 2 - 3, 5 - 4, 6 - 3])


def test_equal_rewards_give_zero_advantage_and_singletons_too() -> None:
    adv = group_advantages(torch.tensor([2.0, 2.0, 7.0]), torch.tensor([0, 0, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_precomputed_advantage_column_wins() -> None:
    t = pa.table({"token_ids": [[1, 2], [1, 3]], "input_id": ["q", "q"], "reward": [0.0, 1.0], "advantage": [0.25, -4.0]})
    assert collate(t).advantages.tolist() == [0.25, -4.0]  # type: ignore[union-attr]


def test_split_group_is_rejected_with_group_size() -> None:
    t = pa.table({"token_ids": [[1, 2]] * 3, "input_id": ["q1", "q1", "q2"], "reward": [0.0, 1.0, 1.0]})
    with pytest.raises(ValueError, match=r"group 'q2' has 1 samples .* group_size=2"):
        collate(t, group_size=2)
    collate(t.slice(0, 2), group_size=2)


def test_loss_mask_column_overrides_prompt_len() -> None:
    t = pa.table({"token_ids": [[5, 6, 7, 8, 9]], "prompt_len": [1],
                  "loss_mask": pa.array([[1, 1, 0, 1, 1]], pa.list_(pa.int8()))})
    b = collate(t)
    # the first token is never a target, even if the mask says so
    assert b.loss_mask.int().tolist() == [[0, 1, 0, 1, 1]]


def test_errors_name_the_sample_and_column() -> None:
    t = _table()
    bad = t.set_column(t.column_names.index("logprobs"), "logprobs",
                       pa.array([[-1.0], [-4.0], [-5.0], [0.0]], pa.list_(pa.float32())))
    with pytest.raises(ValueError, match=r"'logprobs' has 1 entries for sample 'a_0_0'.*expected 5 .* or 3"):
        collate(bad)
    nulls = t.set_column(t.column_names.index("token_ids"), "token_ids",
                         pa.array([[1, 2], None, [1], [1]], pa.list_(pa.int32())))
    with pytest.raises(ValueError, match=r"'token_ids' is null for sample 'a_0_1'"):
        collate(nulls)
    with pytest.raises(ValueError, match=r"no column 'tokens'"):
        collate(t, columns=Columns(token_ids="tokens"))
    too_long = t.set_column(t.column_names.index("prompt_len"), "prompt_len", pa.array([2, 9, 3, 3], pa.int32()))
    with pytest.raises(ValueError, match=r"'prompt_len' is 9 for sample 'a_0_1'"):
        collate(too_long)


def test_pack_first_fit() -> None:
    rows, offsets = pack_first_fit([5, 3, 4, 2, 6], 8)
    assert rows.tolist() == [0, 0, 1, 1, 2]
    assert offsets.tolist() == [0, 5, 0, 4, 0]
    with pytest.raises(ValueError, match="more than pack_length=8"):
        pack_first_fit([9], 8)


def test_packed_rows_give_the_same_logits_as_padded_rows() -> None:
    t = _table()
    padded, packed = collate(t), collate(t, pack_length=8)
    assert packed.packed and packed.input_ids.shape == (3, 8)
    assert packed.num_loss_tokens == padded.num_loss_tokens
    model = build_tiny_lm(seed=3).double()
    with torch.no_grad():
        lp_pad = token_logprobs(model(padded.input_ids, padded.position_ids), padded.input_ids)
        lp_pack = token_logprobs(model(packed.input_ids, packed.position_ids, packed.segment_ids), packed.input_ids)
    for i in range(padded.num_samples):
        a = lp_pad[padded.loss_mask & (padded.segment_ids == i)]
        b = lp_pack[packed.loss_mask & (packed.segment_ids == i)]
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # per-sample values spread onto tokens follow the samples into their packed rows
    tok_r = packed.per_token(packed.rewards)  # type: ignore[arg-type]
    assert tok_r[packed.segment_ids == 0].unique().tolist() == [1.0]
    assert tok_r[packed.segment_ids == -1].abs().sum() == 0


def test_tensor_columns_round_trip_through_store_tensors() -> None:
    tensors = pytest.importorskip("store.tensors", reason="store.tensors is not available")
    same = tensors.to_arrow([np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)])
    ragged = tensors.to_arrow([np.zeros(2, np.int64), np.zeros(3, np.int64)])
    t = pa.table({"token_ids": [[1, 2], [3, 4]], "obs": same, "ragged": ragged})
    b = collate(t)
    assert isinstance(b.extras["obs"], torch.Tensor) and b.extras["obs"].shape == (2, 2, 3)
    assert b.extras["obs"][0, 1].tolist() == [3.0, 4.0, 5.0]
    assert isinstance(b.extras["ragged"], list) and [x.shape[0] for x in b.extras["ragged"]] == [2, 3]
    with pytest.raises(TypeError, match="'token_ids' has type"):
        collate(t, tensor_columns=["token_ids"])


def test_to_device_and_record_batch_input() -> None:
    b = collate(_table().to_batches()[0]).to("cpu")
    assert b.input_ids.device.type == "cpu" and b.num_samples == 4
