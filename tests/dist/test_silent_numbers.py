"""Issue 35 section 7: silent wrong numbers (state facts, materialize, clip with ignored
parameters), each against a reference, at 2 and 3 ranks."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import silent_numbers_workers as W


@pytest.mark.parametrize("world", [2, 3])
def test_state_facts_match_fsdp2(world: int) -> None:
    """fully_shard.state(m).offload_policy raised AttributeError; FSDP2's param-group facts
    (policies, params, sizes, dtypes) read the same as torch's own FSDP2 on the same model."""
    run_distributed(W.state_vs_fsdp2, world, timeout_s=120, collective_timeout_s=30)
