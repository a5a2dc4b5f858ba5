"""Review: sw.clip_grad_norm_ must return the unsharded model's norm, the same on every rank."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_norms_workers as W


@pytest.mark.parametrize("blocks_replicated", [True, False], ids=["blocks_rep", "root_rep"])
# (inf is left out: Net has an empty shard, see the last test)
@pytest.mark.parametrize("norm_type", [2.0, 1.0], ids=["l2", "l1"])
def test_clip_grad_norm_units_on_different_meshes(blocks_replicated: bool,
                                                  norm_type: float) -> None:
    """grad_norm.py reduces every shard over units[0].mesh.shard_group: units on another mesh
    are summed over the wrong group (replicated grads counted world times) or not reduced at
    all (each rank returns its own local norm)."""
    for got, want in run_distributed(W.mixed_meshes, 2, blocks_replicated, norm_type):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)


def test_clip_grad_norm_inf_with_empty_shard() -> None:
    """An empty shard makes vector_norm(inf) raise on that rank (no identity for max)."""
    for got, want in run_distributed(W.inf_norm_empty_shard, 2, timeout_s=120,
                                     collective_timeout_s=20):
        assert got == pytest.approx(want, rel=1e-5), (got, want)
