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


def test_dp_x_tp_mesh_and_dcp_round_trip(tmp_path: Path) -> None:
    """(dp=2, tp=2): colwise parameters are _StridedShard(0, sf=2) x Shard(0) on the mesh
    passed in; model.state_dict() goes through DCP into models sharded by either engine."""
    for worst in run_distributed(W.parity, 4, (2, 2), ("dp", "tp"), ("dp",), (), "tp",
                                 str(tmp_path / "ckpt")):
        assert max(worst.values()) <= W.TOL, worst


def test_hsdp_through_names() -> None:
    for worst in run_distributed(W.parity, 4, (2, 2), ("dp_rep", "dp_shard"), ("dp_shard",),
                                 ("dp_rep",), None):
        assert max(worst.values()) <= W.TOL, worst


def test_two_shard_dims_flattened() -> None:
    """shard=("dp_shard", "cp"): one shard group of 4, the parameters on FSDP2's flattened
    "dp_shard_cp" mesh."""
    for worst in run_distributed(W.parity, 4, (2, 2), ("dp_shard", "cp"), ("dp_shard", "cp"),
                                 (), None):
        assert max(worst.values()) <= W.TOL, worst
