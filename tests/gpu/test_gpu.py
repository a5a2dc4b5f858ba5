"""Opt-in GPU tests (NCCL, CPU offload, bf16 on device); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import run_distributed
from tests.gpu import workers


def _world() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("offload", [False, True])
def test_nccl_parity(strategy: str, offload: bool) -> None:
    worst = run_distributed(workers.parity, _world(), strategy, offload, None, backend="nccl")
    assert max(worst) < 1e-4  # TF32/cuBLAS reductions differ slightly from the reference


@pytest.mark.gpu
def test_bf16_on_device_tracks_fp32() -> None:
    worst = run_distributed(workers.parity, _world(), "FULL_SHARD", False, "bf16",
                            backend="nccl")
    assert max(worst) < 3e-2
