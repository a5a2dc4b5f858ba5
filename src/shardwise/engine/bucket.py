"""A unit's flat layout per communication dtype (`FlatBucket`) and a gather in flight.

One all-gather and one reduction per bucket move all of its parameters ([Note: layout] in
sharded_param.py for one parameter's rows, [Note: parameter messages] in comm/transport.py
for how the pair transport moves them in parts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm.transport import own_message
from .comm.work import Work
from .sharded_param import ShardedParam


@dataclass
class FlatBucket:
    """Parameters of a unit that share a communication dtype, and their flat layout."""

    dtype: torch.dtype
    params: list[ShardedParam]
    offsets: list[int] = field(default_factory=list)  # into one rank's all-gather chunk
    numel: int = 0  # one rank's chunk
    grad_params: list[ShardedParam] = field(default_factory=list)
    grad_offsets: list[int] = field(default_factory=list)
    grad_numel: int = 0
    sizes: list[int] = field(default_factory=list)  # each parameter's chunk, in order
    # Moving in parts ([Note: parameter messages]): the parameters too small for a message
    # of their own, packed together, and the chunk numel of that pack.
    small: list[ShardedParam] = field(default_factory=list)
    small_numel: int = 0

    def __post_init__(self) -> None:
        for p in self.params:
            self.sizes.append(p.chunk_numel)
            self.offsets.append(self.numel)
            self.numel += p.chunk_numel
            if p.requires_grad:
                self.grad_params.append(p)
                self.grad_offsets.append(self.grad_numel)
                self.grad_numel += p.chunk_numel
            if p.chunk_numel and not own_message(p.chunk_numel, self.dtype.itemsize):
                self.small.append(p)
                self.small_numel += p.chunk_numel
        self._plan: PartsPlan | None = None

    def parts_plan(self, me: int, peer: int) -> PartsPlan:
        """The views a gather in parts moves (made once: a step pays no per-parameter
        slicing for them; remade when a parameter's buffers were replaced)."""
        plan = self._plan
        if plan is None or plan.builds != ShardedParam.builds or plan.me != me:
            plan = self._plan = PartsPlan.of(self, me, peer)
        return plan


@dataclass
class PartsPlan:
    """A bucket's gather in parts ([Note: parameter messages]) as lists of views: row `me`
    of each unsharded buffer (filled from the shard, sent from there), and what arrives."""

    me: int
    builds: int
    dst: list[torch.Tensor]  # this rank's row of every parameter's unsharded buffer
    src: list[torch.Tensor]  # every parameter's padded shard, flat
    mine: list[torch.Tensor]  # the rows that go as messages of their own
    theirs: list[torch.Tensor]  # and where the peer's rows of them arrive
    small_mine: list[torch.Tensor]  # the small ones' rows, packed into one message
    small_theirs: list[torch.Tensor]  # where the peer's small rows are unpacked to

    @classmethod
    def of(cls, g: FlatBucket, me: int, peer: int) -> PartsPlan:
        small = {id(p) for p in g.small}
        rows = [p.unsharded_rows_view() for p in g.params]
        big = [(p, r) for p, r in zip(g.params, rows) if r.shape[1] and id(p) not in small]
        return cls(me, ShardedParam.builds, [r[me] for r in rows],
                   [p.padded_shard.reshape(-1) for p in g.params],
                   [r[me] for _, r in big], [r[peer] for _, r in big],
                   [p.unsharded_rows_view()[me] for p in g.small],
                   [p.unsharded_rows_view()[peer] for p in g.small])


@dataclass
class PendingGather:
    bucket: FlatBucket
    send: torch.Tensor | None  # None: a view of `out` ([Note: pair transport])
    # The rank-major output; in parts ([Note: parameter messages]) only the small pack.
    out: torch.Tensor | None
    work: Work
    start: float
    blocked: float = 0.0  # seconds a synchronous all-gather held the caller inside the call
    parts: bool = False
