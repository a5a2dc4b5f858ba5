"""hpZ's refusals ([Note: hpZ] in engine/core/unit.py) are raised before any process group
is made; the ones that need more ranks than a test can start (HYBRID_SHARD with a shard
group of 4 or more) are checked here on the mesh description alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardwise.engine.core.policies import MeshInfo
from shardwise.engine.core.unit import check_hpz, check_params


def _mesh(shard: int, replicas: int) -> MeshInfo:
    return MeshInfo(None, 0, shard, None, replicas, torch.device("cpu"))


def test_hsdp_mesh_is_refused_with_the_sizes() -> None:
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 .* HYBRID_SHARD "
                       r"mesh \(2 replicas\)"):
        check_hpz(2, _mesh(4, 2), None, "Block")


def test_tensor_parallel_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        check_hpz(2, _mesh(4, 1), SimpleNamespace(), "Block")  # type: ignore[arg-type]


def test_a_1d_mesh_passes() -> None:
    check_hpz(2, _mesh(4, 1), None, "Block")


def test_subclass_parameters_are_named() -> None:
    unit = SimpleNamespace(params=[SimpleNamespace(fqn="q.weight", subclass=True),
                                   SimpleNamespace(fqn="q.bias", subclass=False)])
    with pytest.raises(NotImplementedError, match=r"\['q.weight'\]"):
        check_params(unit, 2)  # type: ignore[arg-type]
