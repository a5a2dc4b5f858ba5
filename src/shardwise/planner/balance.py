"""How evenly the model states spread over a shard group: rank 0 (the most) against the mean.

[Note: balanced shards] (engine/core/layout.py) picks each parameter's shard dim; what it
cannot fix (no dim divides the group well) shows here. The mean over the S ranks is exact:
the model states of every shard rank, averaged. Ranks with the same row counts on every
parameter cost the same, so each distinct rank class is costed once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..engine.core.layout import balanced_shard_dim
from .units import PlanUnit


@dataclass(frozen=True)
class Balance:
    max_bytes: int  # model states of the rank holding the most (rank 0)
    mean_bytes: float  # mean over the shard group's ranks
    worst: str  # the parameter with the most elements above its even share ("": none)
    worst_ratio: float  # its largest shard over its mean shard

    @property
    def ratio(self) -> float:
        return self.max_bytes / self.mean_bytes if self.mean_bytes else 1.0

    def describe(self) -> str:
        line = (f"shard balance: rank 0 holds {self.ratio:.3f}x the mean rank's model states "
                f"({(self.ratio - 1) * 100:.1f}% above)")
        if self.worst:
            line += (f"; most uneven bytes: {self.worst} (its largest shard "
                     f"{self.worst_ratio:.2f}x its mean)")
        return line


def _rows(shape: tuple[int, ...], S: int, r: int, balance: bool) -> int:
    dims = shape if shape else (1,)
    d = balanced_shard_dim(dims, S) if balance else 0
    C = -(-dims[d] // S)
    return min((r + 1) * C, dims[d]) - min(r * C, dims[d])


def shard_balance(units: list[PlanUnit], S: int, states_of_rank: Callable[[int], int],
                  balance: bool = True) -> Balance:
    """`states_of_rank(r)`: model-state bytes of shard rank r (the planner's own costing)."""
    classes: dict[tuple[int, ...], int] = {}  # row counts on every parameter -> ranks
    first: dict[tuple[int, ...], int] = {}
    params = [p for u in units for p in u.spec.params]
    for r in range(S):
        key = tuple(_rows(p.shape, S, r, balance) for p in params)
        classes[key] = classes.get(key, 0) + 1
        first.setdefault(key, r)
    total = sum(n * states_of_rank(first[k]) for k, n in classes.items())
    # The parameter with the most elements above its even share on rank 0 (not the worst
    # ratio: a tiny router matrix can be 4x uneven and not matter).
    worst, worst_ratio, most = "", 1.0, 0
    for p in params:
        dims = p.shape if p.shape else (1,)
        d = balanced_shard_dim(dims, S) if balance else 0
        if not dims[d]:
            continue
        chunk = -(-dims[d] // S)
        excess = (chunk * S - dims[d]) * (p.numel // dims[d] if p.shape else 1)
        if excess > most:
            worst, worst_ratio, most = p.fqn, chunk * S / dims[d], excess
    return Balance(states_of_rank(0), total / S, worst, worst_ratio)
