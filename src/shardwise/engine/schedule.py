"""The step schedule: when each unit gathers, reshards and reduces. Decisions only.

This module holds no tensors and calls no collectives. It decides, and the units it is given
act. Two kinds of unit drive the same `Schedule`: the engine's `Unit` (real all-gathers and
reduce-scatters, engine/hooks.py) and the planner's byte-counting stand-in
(planner/simulate.py). So the planner's memory replay cannot disagree with the engine about
prefetching, in-flight limits, resharding or draining: they run this same code.

[Note: prefetch] The order in which units run forward is recorded on every step; the next
step uses the previous step's order to issue unit i+1's all-gather while unit i computes,
and in backward unit i-1's while unit i computes. At most `Limits.gathers` all-gathers are
in flight. A step whose order differs from the recorded one still computes correctly: a unit
that was not prefetched gathers synchronously, and one prefetched in vain is resharded at
the end of forward. The new order is used from the next step on.

[Note: reduce limit] Each pending reduction holds a unit-sized send buffer until it is
waited for; at most `Limits.reduces` are pending, the oldest is finished first.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class ShardedState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = "sharded"  # only shards exist
    GATHERING = "gathering"  # all-gather issued, not yet waited
    UNSHARDED = "unsharded"  # full parameters registered on the modules


class TrainingState(enum.Enum):
    """What a unit (or the whole model) is doing in the step, as FSDP2's per-group state."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"  # gathered for, or running, its backward
    POST_BACKWARD = "post_backward"  # its backward is over and its gradients were handed on


@dataclass(frozen=True)
class Limits:
    """How much communication may be in flight at once (memory: one unit-sized buffer each).

    gathers: all-gathers issued ahead of need (0: every unit gathers when it is needed).
    reduces: reductions pending at once (at least 1: the one just issued).
    """

    gathers: int = 2
    reduces: int = 2

    def __post_init__(self) -> None:
        for name, least in (("gathers", 0), ("reduces", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"Limits.{name}={v!r} must be an int >= {least}")


DEFAULT_LIMITS = Limits()


class PendingReduce(Protocol):
    def finish(self) -> None:
        """Wait for the reduction and write its result (idempotent)."""


class ScheduledUnit(Protocol):
    """What the schedule needs of a unit; engine/unit.py and planner/simulate.py implement it."""

    state: ShardedState
    training_state: TrainingState
    reshard_after_forward: bool
    reshards_after_forward: bool  # this step: reshard_after_forward, with the root's rule
    reshard_after_backward: bool
    is_root: bool

    def unshard(self, async_op: bool = True) -> None: ...
    def wait_unshard(self) -> None: ...
    def reshard(self) -> None: ...
    def reduce_grads(self) -> Sequence[PendingReduce]: ...
    def has_unreduced_grads(self) -> bool: ...


U = TypeVar("U", bound=ScheduledUnit)


class Schedule(Generic[U]):
    """The decisions of one model's steps, over its units (`units[0]` need not be the root)."""

    def __init__(self, units: list[U], limits: Limits = DEFAULT_LIMITS,
                 prefetch: bool = True) -> None:
        self.units = units
        self.limits = limits
        self.prefetch = prefetch
        self.state = TrainingState.IDLE
        # Forward order recorded on the previous step (used to prefetch) and this step's.
        self.order: list[U] = []
        self.order_now: list[U] = []
        self._index: dict[int, int] = {}
        self.pending: deque[PendingReduce] = deque()
        # Statistics the tests and the planner read: prefetches issued, most in flight.
        self.prefetches = 0
        self.most_gathers = 0
        self.most_reduces = 0

    # --- forward ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self.state = TrainingState.FORWARD
        self.order_now = []

    def pre_forward(self, unit: U) -> None:
        """`unit` is about to compute: its parameters must be there; the next one's may come."""
        unit.training_state = TrainingState.FORWARD
        self.order_now.append(unit)
        unit.wait_unshard()
        if not self.prefetch or not self.order:
            return
        pos = len(self.order_now) - 1
        if pos >= len(self.order) or self.order[pos] is not unit:
            return  # order changed this step: no guessing
        if pos + 1 < len(self.order):
            self._prefetch(self.order[pos + 1])

    def post_forward(self, unit: U) -> None:
        if unit.reshards_after_forward:
            unit.reshard()
        unit.training_state = TrainingState.IDLE

    def end_forward(self, backward_follows: bool) -> None:
        """The root's forward is over. Without a backward to come nothing stays gathered."""
        if [id(u) for u in self.order_now] != [id(u) for u in self.order]:
            self.order = list(self.order_now)
            self._index = {id(u): i for i, u in enumerate(self.order)}
        for u in self.units:
            # A prefetch nobody used, or (no backward) anything.
            if u.state is ShardedState.GATHERING or (
                    not backward_follows and u.state is not ShardedState.SHARDED):
                u.reshard()
        self.state = TrainingState.IDLE

    # --- backward -----------------------------------------------------------------------

    def pre_backward(self, unit: U) -> None:
        """`unit`'s backward is about to run (once per gradient reaching its outputs)."""
        self.state = TrainingState.PRE_BACKWARD
        unit.training_state = TrainingState.PRE_BACKWARD
        if _unshards_in_backward(unit):
            unit.wait_unshard()
        if not self.prefetch or not self.order:
            return
        i = self._index.get(id(unit))
        if i is not None and i > 0 and _unshards_in_backward(self.order[i - 1]):
            self._prefetch(self.order[i - 1])

    def post_backward(self, unit: U) -> None:
        """`unit`'s backward is over: hand its gradients on, then reshard."""
        unit.training_state = TrainingState.POST_BACKWARD
        for pr in unit.reduce_grads():
            self.pending.append(pr)
            while len(self.pending) > self.limits.reduces:
                self.pending.popleft().finish()
            self.most_reduces = max(self.most_reduces, len(self.pending))
        if unit.reshard_after_backward:
            unit.reshard()

    def end_backward(self) -> None:
        """After the whole backward: finish the units whose post-backward never ran (inputs
        that need no gradient), wait for every reduction, reshard everything."""
        # Reverse forward order is the order the units' post-backward would have run.
        seen = {id(u) for u in self.order}
        for u in list(reversed(self.order)) + [u for u in self.units if id(u) not in seen]:
            if u.state is not ShardedState.SHARDED or u.has_unreduced_grads():
                self.post_backward(u)
        while self.pending:
            self.pending.popleft().finish()
        for u in self.units:
            if u.reshard_after_backward:
                u.reshard()
            u.training_state = TrainingState.IDLE
        self.state = TrainingState.IDLE

    # --- prefetch -----------------------------------------------------------------------

    def _prefetch(self, unit: U) -> None:
        if unit.state is not ShardedState.SHARDED:
            return
        in_flight = sum(1 for u in self.units if u.state is ShardedState.GATHERING)
        if in_flight < self.limits.gathers:
            unit.unshard(async_op=True)
            self.prefetches += 1
            self.most_gathers = max(self.most_gathers, in_flight + 1)


def _unshards_in_backward(unit: ScheduledUnit) -> bool:
    """False for a unit whose backward needs no parameter values (set_unshard_in_backward)."""
    return getattr(unit, "unshard_in_backward", True)
