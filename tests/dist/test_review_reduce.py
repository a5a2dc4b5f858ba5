"""Gradient reduction against the unsharded mean (tests/dist/review_reduce_workers.py)."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import run_distributed
from tests.dist import review_reduce_workers as W


@pytest.mark.parametrize("reduce_bf16", [False, True], ids=["fp32", "reduce-bf16"])
def test_no_shard_accumulation_with_a_parameter_unused_on_one_rank(reduce_bf16: bool) -> None:
    """NO_SHARD, two synced backwards without zero_grad, b unused on rank 0 in the second:
    b.grad must be 1.5 + 1.0 (it was 1.75: rank 0 sent zeros for its accumulated 1.5 and the
    reduced result replaced the accumulated gradient)."""
    for r in run_distributed(W.direct_accumulate, 2, reduce_bf16):
        assert r["b"] == pytest.approx([2.5] * 3), r
        assert r["a"] == pytest.approx([3.0] * 3), r


def test_no_shard_unit_called_twice_with_rank_dependent_use() -> None:
    """NO_SHARD unit called twice in one forward, b used by a different call on each rank:
    b.grad must be mean(x) = 1.5 (it was 0.5: the second reduction replaced the first)."""
    for g in run_distributed(W.direct_unit_called_twice, 2):
        assert g == pytest.approx([1.5] * 3), g


@pytest.mark.parametrize("dtypes", [(None, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32-reduce-bf16", "bf16-reduce-fp32"])
def test_no_sync_mixed_precision_rank_dependent_use_two_ranks(dtypes: tuple) -> None:
    """2 ranks (the pair transport then), no_sync then a synced micro-batch, b used on a different
    rank in each: every row of a.grad must be 3.0 and of b.grad 1.5 (they were 2/4 and
    1/2: rank 0 reduced in parts, rank 1 packed, and the messages did not match)."""
    for r in run_distributed(W.mixed_path_no_sync, 2, *dtypes):
        assert r["a"] == pytest.approx([3.0] * 4), r
        assert r["b"] == pytest.approx([1.5] * 4), r
