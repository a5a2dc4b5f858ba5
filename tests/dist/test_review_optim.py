"""Optimizer steps on sharded parameters: silent wrong numbers found by review
(review_optim_workers.py). The optimizer fast path these were found on went with issue 35;
the steps now run on the DTensor shards, as on FSDP2."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_optim_workers as W


@pytest.mark.parametrize("name,fused", [("AdamW", True), ("SGD", False)])
def test_fused_step_after_forward_without_backward(name: str, fused: bool) -> None:
    # SGD's fused kernel has no DTensor sharding rule in torch 2.13 (FSDP2 fails the same
    # way: "aten._fused_sgd_.default does not have a sharding strategy"); its foreach step
    # writes the shards in place just as well.
    run_distributed(W.fused_step_after_forward_without_backward, 2, name, fused)


@pytest.mark.parametrize("kind", ["clip", "reassign"])
def test_step_pre_hook_sees_dtensor_parameters(kind: str) -> None:
    run_distributed(W.step_pre_hook_sees_dtensor_parameters, 2, kind)
