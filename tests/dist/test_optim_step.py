"""Issue 23: torch's optimizers on sharded parameters at the cost of plain tensors."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import optim_step_workers as W


@pytest.mark.parametrize("world,name", [(2, "AdamW"), (3, "Adam"), (3, "SGD")])
def test_fast_path_matches_dtensor_and_reference(world: int, name: str) -> None:
    run_distributed(W.matches_dtensor_and_reference, world, name)


def test_closure_and_failed_step() -> None:
    run_distributed(W.closure_and_failed_step, 2)
