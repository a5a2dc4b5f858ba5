"""Issue 14: sharded parameters are DTensors, so PyTorch's own tools give unsharded answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import dtensor_workers as W


@pytest.mark.parametrize("world,hybrid", [(2, False), (3, False), (4, True)])
def test_clip_grad_norm_and_state_dict(world: int, hybrid: bool) -> None:
    run_distributed(W.clip_and_state_dict, world, hybrid)


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_state_dict_helpers(world: int) -> None:
    run_distributed(W.dcp_state_dicts, world)


@pytest.mark.parametrize("save_world,load_world", [(2, 3), (3, 2)])
def test_dcp_save_load_other_world_size(tmp_path: Path, save_world: int,
                                         load_world: int) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(W.dcp_save, save_world, path)
    run_distributed(W.dcp_load_and_step, load_world, path)


def test_fsdp2_module_methods_and_policies() -> None:
    from tests.dist import fsdp2_api_workers as A

    run_distributed(A.api, 2)
