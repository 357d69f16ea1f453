"""The torch devices a test runs on: the CPU always, the first GPU where torch sees one.

CUDA cases carry the ``gpu`` marker, which the default run deselects (``-m 'not slow and not
gpu'``); ``pytest -m gpu`` on a machine with a GPU runs them, and skips them with the reason
where torch sees none.
"""
from __future__ import annotations

import pytest
import torch

_NO_CUDA = f"torch {torch.__version__} sees no CUDA device"

CUDA = pytest.param("cuda", id="cuda", marks=(
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)))
DEVICES = ["cpu", CUDA]
