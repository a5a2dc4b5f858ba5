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


def _changes(shape: tuple[int, ...], S: int, balance: bool) -> tuple[int, ...]:
    """The shard ranks whose row count of this parameter differs from the rank before.

    Chunked by C = ceil(n / S) rows, ranks below q = n // C hold C rows, rank q holds the
    rest (less than C, maybe none) and the ranks after it none: so a rank's count changes at
    q, and again at q + 1 when the rest is not empty."""
    dims = shape if shape else (1,)
    d = balanced_shard_dim(dims, S) if balance else 0
    n = dims[d]
    if n == 0:
        return ()
    q, rest = divmod(n, -(-n // S))
    return tuple(r for r in (q, q + 1 if rest else S) if r < S)


def shard_balance(units: list[PlanUnit], S: int, states_of_rank: Callable[[int], int],
                  balance: bool = True) -> Balance:
    """`states_of_rank(r)`: model-state bytes of shard rank r (the planner's own costing)."""
    params = [p for u in units for p in u.spec.params]
    # Each parameter's row count never grows with the rank (C, ..., C, the rest, 0, ...), so
    # the ranks between two consecutive changes of any parameter hold the same rows of every
    # parameter and cost the same: one costing per such run of ranks, whatever S is (a
    # rank-by-rank walk took S x parameters steps: 600K per call for a 7B model's
    # suggestions at thousands of ranks, minutes per plan).
    starts = sorted({0, *(r for p in params for r in _changes(p.shape, S, balance))})
    ends = [*starts[1:], S]
    total = sum((end - start) * states_of_rank(start) for start, end in zip(starts, ends))
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
