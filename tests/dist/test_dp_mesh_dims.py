"""Issue 36: fully_shard(module, mesh=full_spmd_mesh, dp_mesh_dims=DataParallelMeshDims(...)),
torch 2.13's full-DTensor mode (torchtitan's spmd_backend="full_dtensor"). Each case runs the
same client code on shardwise and on FSDP2 in one process group: the sharded parameters and
gradients have FSDP2's meshes and placements, and losses, clipped norms, gradients and
parameters match FSDP2 and an unsharded reference at 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import dp_mesh_dims_workers as W


@pytest.mark.parametrize("world", [2, 3])
def test_1d_dp_mesh_replicated_dtensors(world: int) -> None:
    for worst in run_distributed(W.parity, world, (world,), ("dp",), ("dp",), (), None):
        assert max(worst.values()) <= W.TOL, worst


def test_4_ranks_dp_x_tp_hsdp_by_names_flattened_shard_dims(tmp_path: Path) -> None:
    """On 4 ranks, one process group:
    - (dp=2, tp=2), shard="dp": colwise parameters are (_StridedShard(0, sf=2), Shard(0)) on
      the mesh passed in; model.state_dict() goes through DCP into models sharded by
      either engine, and back through load_state_dict;
    - (dp_rep=2, dp_shard=2), replicate="dp_rep", shard="dp_shard": HSDP by names;
    - (dp_shard=2, cp=2), shard=("dp_shard", "cp"): one shard group of 4, parameters on
      FSDP2's flattened "dp_shard_cp" mesh.
    """
    cases = [((2, 2), ("dp", "tp"), ("dp",), (), "tp"),
             ((2, 2), ("dp_rep", "dp_shard"), ("dp_shard",), ("dp_rep",), None),
             ((2, 2), ("dp_shard", "cp"), ("dp_shard", "cp"), (), None)]
    for worst in run_distributed(W.parity_grid, 4, cases, str(tmp_path / "ckpt"),
                                 timeout_s=400):
        assert max(worst.values()) <= W.TOL, worst


def test_bad_input_raises_as_fsdp2_before_any_collective() -> None:
    msgs = run_distributed(W.bad_input, 4)[0]
    assert len(msgs) == 7, msgs
