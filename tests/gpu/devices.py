"""How many GPUs the GPU tests have, and the skip that says so."""

from __future__ import annotations

import pytest
import torch


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip, saying why, where fewer than `n` GPUs exist (NCCL takes one GPU per rank)."""
    have = gpus()
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPUs (NCCL refuses two ranks on "
                                               f"one device); this machine has {have}")
