"""Two ranks sharing ONE GPU: every collective runs, on a machine with a single GPU.

NCCL refuses two ranks on the same device, so the ranks join a gloo world and shard with a
CUDA DeviceMesh over it: the units, their buffers and streams live on cuda:0 and gloo moves
the flat buffers, staging them through pinned host memory.

[Note: gloo on CUDA] Which gloo collectives take CUDA tensors (ProcessGroupGloo in the torch
2.x sources): `all_to_all_single` (alltoall_base) has a CUDA path of its own (copy to pinned
host memory, exchange, copy back on a side stream that the caller's stream then waits for),
as do allgather / all_gather_into_tensor and allreduce. `reduce_scatter_tensor` has none: it
is emulated by a clone of the whole input plus a full all-reduce, twice the bytes, behind a
Work that only runs its copy when waited. allgather_coalesced and allreduce_coalesced are
CPU only. So these tests keep the engine's default on gloo, all-to-all for both the gather
and the reduce-scatter (transport.py, SHARDWISE_GLOO_NATIVE unset): the one op with a real
CUDA path for both directions, moving (S-1)/S of the buffer, and the path every CPU gloo
test already checks bit for bit against the native one. The tests assert that choice.
"""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.gpu import workers

TOL = 1e-4
CASE_S = 120.0


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("offload", [False, True])
def test_two_ranks_share_one_gpu_over_gloo(strategy: str, offload: bool) -> None:
    out = run_distributed(workers.shared_gpu_parity, 2, strategy, offload, backend="gloo",
                          timeout_s=CASE_S, env={"SHARDWISE_GLOO_NATIVE": "0"})
    for r in out:
        assert r["backend"] == "gloo", r
        assert r["unit_devices"] == ["cuda:0"], r
        assert r["transports"] == ["all_to_all"], r
    assert max(r["worst"] for r in out) < TOL, out


@pytest.mark.gpu
def test_grad_scaler_inf_on_one_rank_skips_every_rank() -> None:
    # The found-inf flag is computed on the GPU and reduced over gloo on the host: it must
    # reach the host before it is read, or a rank reads a flag its copy has not written yet.
    trials = 5
    out = run_distributed(workers.shared_gpu_scaler, 2, trials, backend="gloo",
                          timeout_s=CASE_S)
    assert out == [[False] * trials + [True]] * 2, out
