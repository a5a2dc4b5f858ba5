"""Review: the forward data path against an unsharded reference (forward/backward under
options). See review_path_workers.py for the mechanism."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_path_workers as W


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("keep", ["grad_forward", "no_reshard_after_backward"])
@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_forward_sees_shards_updated_while_gathered(world: int, keep: str, how: str) -> None:
    """A unit still gathered from the last pass must not compute with stale parameters after
    its shards were updated in place. The `.data` updates are not seen by the version-counter
    check in ModelContext.begin_forward (engine/core/context.py, Unit.shards_changed_since_gather
    in engine/core/unit.py): the next forward silently uses the old full parameters."""
    for diffs in run_distributed(W.stale_after_update, world, keep, how, timeout_s=120):
        assert max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("world", [2, 3])
def test_inference_mode_forward_between_training_steps(world: int) -> None:
    for diffs in run_distributed(W.inference_mode_between_steps, world, timeout_s=120):
        assert max(diffs) < 1e-5, diffs
