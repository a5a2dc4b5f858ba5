"""Balanced shards ([Note: balanced shards] in engine/core/layout.py): the rule, and the
planner using it for every rank's model states."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.engine.core.layout import balanced_shard_dim, imbalance, max_shard_numel

GIB = 2**30


@pytest.mark.parametrize("shape, group, dim", [
    ((8, 14336, 4096), 32, 1),  # Mixtral's experts at 32 ranks: 14336 = 32 x 448
    ((8, 14336, 4096), 8, 0),  # dim 0 divides: FSDP2's layout kept
    ((8, 14336, 4096), 1, 0),
    ((8, 4096), 32, 0),  # 2-D keeps dim 0 even when uneven (FSDP2's grid checks it)
    ((7,), 4, 0),
    ((), 4, 0),
    ((2, 6, 10), 3, 1),  # dim 1: 2 of 6 rows each (40 elements); dim 2: 4 of 10 (48)
    ((2, 6, 10), 4, 2),  # dim 1: 2 of 6 (40); dim 2: 3 of 10 (36)
    ((3, 4, 4), 4, 1),  # rank 3 empty on dim 0; dims 1 and 2 tie: the lowest wins
    ((3, 5, 7), 4, 2),  # nothing divides: dim 0 1 x 35, dim 1 2 x 21, dim 2 2 x 15 (least)
    ((8, 4, 6), 6, 2),  # 8 experts at 6 ranks: dim 0 gives 2, 2, 2, 2, 0, 0
    # Uneven but no rank empty: FSDP2's layout, as the ported FSDP2 grid checks it (a conv
    # weight (17, 3, 4, 4) at 2 ranks holds 9 and 8 rows there too).
    ((17, 3, 4, 4), 2, 0),
    ((3, 4, 4), 2, 0),
    ((10, 6, 10), 4, 0),  # 3, 3, 3, 1 rows (9 at 4 ranks is 3, 3, 3, 0: moved)
    ((9, 6, 10), 4, 2),
])
def test_balanced_dim(shape: tuple[int, ...], group: int, dim: int) -> None:
    assert balanced_shard_dim(shape, group) == dim
    if len(shape) < 3 or dim == 0:
        return
    best = min(max_shard_numel(shape, d, group) for d in range(max(len(shape), 1)))
    assert max_shard_numel(shape, dim, group) == best


def test_imbalance_of_experts() -> None:
    assert imbalance((8, 14336, 4096), 0, 32) == pytest.approx(4.0)
    assert imbalance((8, 14336, 4096), 1, 32) == pytest.approx(1.0)


def test_mixtral_at_32_ranks_plans_even_model_states() -> None:
    """Every rank within 2% of 16 bytes x P / 32 (P = 46.7B); rank 0 held 84.75 GiB when
    experts were chunked on dim 0 (8 ranks one expert each, 24 none)."""
    even = None
    for rank in (0, 7, 8, 31):
        p = sw.plan("mixtral-8x7b", world_size=32, mixed_precision="bf16", rank=rank)
        assert 46.6e9 < p.params < 46.8e9
        even = 16 * p.params / 32
        got = p.per_rank.model_states_bytes
        assert abs(got - even) <= 0.02 * even, f"rank {rank}: {got / GIB:.2f} GiB"
    assert p.shard_imbalance < 1.02
    assert "shard balance: rank 0 holds 1.00" in str(p)
    assert even is not None


class Awkward(nn.Module):
    """A 3-D parameter no dim of which divides 4 ranks well, beside an even one."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = nn.Parameter(torch.empty(3, 5, 7, device="meta"))
        self.even = nn.Parameter(torch.empty(64, 16, device="meta"))


def test_plan_reports_the_imbalance_it_still_sees() -> None:
    p = sw.plan(Awkward(), world_size=4, auto_wrap_policy=None, optimizer="adamw")
    # odd on dim 2: 2 of 7 slices (30 elements) on ranks 0-2, 15 on rank 3; even: 256 on
    # each. The padded shard buffer exists on every rank; AdamW's state follows the valid
    # rows, so rank 3 holds less and rank 0 sits above the mean.
    assert 1.0 < p.shard_imbalance < 1.05
    text = str(p)
    assert "most uneven bytes: odd" in text
    assert f"{p.shard_imbalance:.3f}x the mean" in text
    per = [sw.plan(Awkward(), world_size=4, auto_wrap_policy=None, optimizer="adamw",
                   rank=r).per_rank.model_states_bytes for r in range(4)]
    assert p.per_rank.model_states_bytes == max(per)
    assert p.shard_imbalance == pytest.approx(max(per) / (sum(per) / 4))
