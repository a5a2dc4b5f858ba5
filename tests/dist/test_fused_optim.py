"""AdamW fused / foreach on sharded parameters equal the per-parameter loop (2 and 3 ranks)."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import fused_optim_workers as W


@pytest.mark.parametrize("world", [2, 3])
def test_fused_and_foreach_match_the_loop(world: int) -> None:
    run_distributed(W.fused_and_foreach_match_the_loop, world)
