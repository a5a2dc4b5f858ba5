"""The planner's shard balance costs each run of identical ranks once, exactly as a walk
over every rank would (planner/balance.py), and in time independent of the group size: the
walk over every rank made `shardwise plan`'s suggestions for a 7B model take minutes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from shardwise.engine.core.layout import balanced_shard_dim
from shardwise.planner.balance import shard_balance


def rows(shape: tuple[int, ...], S: int, r: int, balance: bool) -> int:
    """Rank r's rows of a parameter, written out: the rank-by-rank reference."""
    dims = shape or (1,)
    d = balanced_shard_dim(dims, S) if balance else 0
    c = -(-dims[d] // S)
    return min((r + 1) * c, dims[d]) - min(r * c, dims[d])


def units_of(shapes: list[tuple[int, ...]]) -> list[SimpleNamespace]:
    params = [SimpleNamespace(shape=s, fqn=f"p{i}", numel=_numel(s)) for i, s in enumerate(shapes)]
    return [SimpleNamespace(spec=SimpleNamespace(params=params))]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("balance", [True, False])
def test_runs_of_ranks_cost_what_every_rank_costs(balance: bool) -> None:
    rng = random.Random(0)
    for _ in range(150):
        shapes = [tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 13, 64, 100])
                        for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 6))]
        S = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 33, 128])
        weights = [rng.randint(1, 9) for _ in shapes]
        calls: list[int] = []

        def states(r: int, shapes=shapes, S=S, weights=weights, calls=calls) -> int:
            calls.append(r)
            return sum(w * rows(s, S, r, balance) for w, s in zip(weights, shapes)) + 1

        got = shard_balance(units_of(shapes), S, states, balance)
        want = sum(sum(w * rows(s, S, r, balance) for w, s in zip(weights, shapes)) + 1
                   for r in range(S)) / S
        assert got.mean_bytes == pytest.approx(want, rel=1e-12), (shapes, S)
        assert got.max_bytes == states(0)
        # Every rank a run starts at differs from the one before it: one costing per class.
        keys = [tuple(rows(s, S, r, balance) for s in shapes) for r in sorted(set(calls[:-1]))]
        assert len(set(keys)) == len(keys), (shapes, S)


def test_the_work_does_not_grow_with_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.planner.balance as B

    looked: list[int] = []

    def counted(shape: tuple[int, ...], group: int) -> int:
        looked.append(group)
        return balanced_shard_dim(shape, group)

    monkeypatch.setattr(B, "balanced_shard_dim", counted)
    shapes = [(32000, 4096), (4096,), *[(4096, 4096)] * 4 * 8, *[(11008, 4096)] * 3 * 8]
    calls: list[int] = []
    shard_balance(units_of(shapes), 8192, lambda r: calls.append(r) or 1)
    # Once per parameter for its rows and once for the most uneven one: not once per rank.
    assert len(looked) <= 2 * len(shapes), len(looked)
    assert len(calls) <= 2 * len({*shapes}) + 1, len(calls)
