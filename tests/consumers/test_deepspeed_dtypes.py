"""The DeepSpeed loop's dtype check, without DeepSpeed (tests/consumers/test_deepspeed_loop.py runs it
through a real engine where DeepSpeed imports)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from consumers.deepspeed_loop import check_gradient_dtypes  # noqa: E402


def test_parameters_of_an_unsupported_dtype_are_named_with_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1).double())
    with pytest.raises(TypeError) as raised:
        check_gradient_dtypes(model, [torch.float32, torch.bfloat16], "cpu")
    message = str(raised.value)
    assert "torch.float64" in message and "'1.weight'" in message
    assert "torch.float32, torch.bfloat16" in message and "model.float()" in message


def test_supported_and_frozen_parameters_pass():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1).double())
    for p in model[1].parameters():
        p.requires_grad_(False)  # no gradient to reduce
    check_gradient_dtypes(model, [torch.float32], "cpu")
