"""Opt-in GPU tests on NCCL (CPU offload, bf16 on the device); skipped without CUDA.

World 1 runs on any GPU machine (no collective: the per-step path alone); world 2 needs two
GPUs and runs every collective on NCCL. Two ranks sharing ONE GPU run over gloo instead
(test_shared_gpu.py).
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.gpu import workers
from tests.gpu.devices import needs_gpus

# TF32/cuBLAS reductions differ slightly from the reference.
TOL = 1e-4
# bf16 parameters against an fp32 reference.
BF16_TOL = 3e-2
# One case's bound (seconds): process start, CUDA and NCCL set-up, 3 steps of a tiny model.
CASE_S = 120.0


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("offload", [False, True])
def test_nccl_parity_world1(strategy: str, offload: bool) -> None:
    worst = run_distributed(workers.parity, 1, strategy, offload, None, backend="nccl",
                            timeout_s=CASE_S)
    assert max(worst) < TOL


@pytest.mark.gpu
def test_bf16_on_device_tracks_fp32_world1() -> None:
    worst = run_distributed(workers.parity, 1, "FULL_SHARD", False, "bf16", backend="nccl",
                            timeout_s=CASE_S)
    assert max(worst) < BF16_TOL


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("offload", [False, True])
def test_nccl_parity_world2(strategy: str, offload: bool) -> None:
    worst = run_distributed(workers.parity, 2, strategy, offload, None, backend="nccl",
                            timeout_s=CASE_S)
    assert max(worst) < TOL, worst


@pytest.mark.gpu
@needs_gpus(2)
def test_bf16_on_device_tracks_fp32_world2() -> None:
    worst = run_distributed(workers.parity, 2, "FULL_SHARD", False, "bf16", backend="nccl",
                            timeout_s=CASE_S)
    assert max(worst) < BF16_TOL, worst
