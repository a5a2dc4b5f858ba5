"""Issue 35 section 7: silent wrong numbers (state facts, materialize, clip with ignored
parameters), each against a reference, at 2 and 3 ranks."""

from __future__ import annotations

import math

import pytest

from shardwise.testing import run_distributed
from tests.dist import silent_numbers_workers as W


@pytest.mark.parametrize("world", [2, 3])
def test_state_facts_match_fsdp2(world: int) -> None:
    """fully_shard.state(m).offload_policy raised AttributeError; FSDP2's param-group facts
    (policies, params, sizes, dtypes) read the same as torch's own FSDP2 on the same model."""
    run_distributed(W.state_vs_fsdp2, world, timeout_s=120, collective_timeout_s=30)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("reduced", [False, True], ids=["per_rank", "user_reduced"])
def test_clip_grad_norm_ignored_params(world: int, norm_type: float, reduced: bool) -> None:
    """Ignored parameters' gradients were counted locally: where they differ per rank, each
    rank returned (and clipped with) its own norm. Now every rank returns the largest norm a
    rank holds, the unsharded model's when they agree, and clips with that one coefficient."""
    run_distributed(W.clip_with_ignored, world, norm_type, reduced, timeout_s=120,
                    collective_timeout_s=30)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("with_init_fn", [False, True], ids=["reset_parameters", "init_fn"])
def test_materialize_matches_unsharded_init(world: int, strategy: str,
                                            with_init_fn: bool) -> None:
    """Initializers ran on each rank's rows with a per-shard-rank stream: fan-based ones
    (xavier's fan_out, orthogonal_) had the wrong scale or structure, and no value matched
    the unsharded model. Now bit-exact against the unsharded init with the same seed."""
    run_distributed(W.materialize_matches_unsharded, world, strategy, with_init_fn,
                    timeout_s=120, collective_timeout_s=30)


@pytest.mark.parametrize("world", [2, 3])
def test_materialize_refuses_unwritten_parameters(world: int) -> None:
    """nn.MultiheadAttention built on meta: in_proj_weight stayed 0.0 with no warning."""
    run_distributed(W.materialize_refuses_unwritten, world, timeout_s=120,
                    collective_timeout_s=30)
