"""Port of upstream test_fully_shard_state.py (upstream runs it at world size 1).

fully_shard_state checks shardwise's unit per call where upstream reads fully_shard.state().
fully_shard_deepcopy accepts a clear exception or a correct copy (issue 12, defect 10);
it runs last because a crash takes the processes with it.
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import state_workers as W
from tests.dist.fsdp2.harness import Case, params_for

WORLDS = (1, 2, 3)

CASES: list[Case] = [
    Case("fully_shard_state", W.fully_shard_state, worlds=WORLDS),
    Case("fully_shard_reapply", W.fully_shard_reapply, worlds=WORLDS),
    Case("fully_shard_cls", W.fully_shard_cls, worlds=WORLDS),
    Case("fully_shard_unsupported_module_cls", W.fully_shard_unsupported_module_cls,
         worlds=WORLDS),
    Case("fully_shard_deepcopy", W.fully_shard_deepcopy, worlds=WORLDS, last=True),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_state(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
