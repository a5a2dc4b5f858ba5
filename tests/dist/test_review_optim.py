"""Optimizer fast path: silent wrong numbers found by review (review_optim_workers.py)."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_optim_workers as W


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_fused_step_after_forward_without_backward(name: str) -> None:
    run_distributed(W.fused_step_after_forward_without_backward, 2, name)


@pytest.mark.parametrize("kind", ["clip", "reassign"])
def test_step_pre_hook_sees_dtensor_parameters(kind: str) -> None:
    run_distributed(W.step_pre_hook_sees_dtensor_parameters, 2, kind)
