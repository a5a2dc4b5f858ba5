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
waited for; at most `Limits.reduces` are pending, the oldest is finished first. A finished
reduction's result is in the sharded gradients, but what it sent may still be read by the
peer ([Note: one-copy release] in comm/one_copy.py): it is released (its gradients and
buffers let go) when the next reduction finishes, and at the end of backward at the latest.

[Note: backward prefetch of the first block] The root's pre-backward comes first in
backward, and the unit whose backward follows it is the last one forward ran. Nothing
prefetched that one, so its all-gather ran alone, exposed, while the root's own backward
(the head and the loss) could have covered it: the root's pre-backward prefetches it.

[Note: lockstep] and [Note: recompute]: the rules that keep every rank's collectives in step
when each rank's data decides which units run are in schedule_lockstep.py.

[Note: decision log] With `Schedule.log` set to a list, the schedule appends every decision
it takes, in order, as (what, unit): "gather" (an all-gather issued), "wait" (a gather waited
for: the full parameters are there), "reshard", "reduce" (the unit's reductions issued) and
"finish" (a pending reduction finished). They are read off the unit's state around each of
the schedule's own calls, so one piece of code logs every executor alike: the engine's
units and the planner's memory and time replays (tests/dist/test_schedule.py holds the
engine's log against the time model's). Without a list (the default) a call pays one
`is None` check.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from .lockstep import Groups
from .schedule_lockstep import LockstepRules


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
    unit: Any  # the unit it reduces (named in the schedule's log)

    def finish(self) -> None:
        """Wait for the reduction and write its result (idempotent)."""

    def release(self) -> None:
        """After `finish`: let go of what was sent once the peer has it (idempotent)."""


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


class Schedule(LockstepRules[U], Generic[U]):
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
        # Finished, not yet released ([Note: reduce limit]): at most one.
        self.releasing: deque[PendingReduce] = deque()
        # Whether this backward has reached any unit yet ([Note: backward prefetch of the
        # first block]).
        self.backward_started = False
        # Statistics the tests and the planner read: prefetches issued, most in flight.
        self.prefetches = 0
        self.most_gathers = 0
        self.most_reduces = 0
        # [Note: lockstep]: the groups of sibling units (set at the first forward), the
        # last member each group reached this step (-1: none), the backward points this
        # forward recorded ("pre"/"post", unit), and how far backward has come through them.
        self.groups: Groups[U] = Groups()
        self.cursor: list[int] = []
        self.points: list[tuple[str, U]] = []
        self.reached = 0
        self.generation = 0
        # Groups whose holder's forward began a round that no member has entered yet.
        self.opened: set[int] = set()
        # [Note: recompute]: the activation-checkpointed region each point was recorded in
        # (None: outside any), and how the engine tells it (None: never in one).
        self.regions: list[object] = []
        self.region_of: Callable[[], object] | None = None
        # The recomputation running (its own region) and the region it replays; the regions
        # replayed in this backward.
        self.replay: tuple[object, object] = (None, None)
        self.replayed: set[object] = set()
        self.grad = False
        self.reduced: set[int] = set()
        # Whether this backward reached a point the last forward recorded ([Note: lockstep]).
        self.touched = False
        # [Note: hooked agreement] (schedule_lockstep.py): the engine's way to learn which
        # units some rank hooked (None: this rank's own suffice), and this forward's flags.
        self.settle: Callable[[], None] | None = None
        self._forget_hooked()
        # [Note: decision log] None: no log is kept (the engine's default; nothing is paid).
        self.log: list[tuple[str, U]] | None = None

    @property
    def in_backward(self) -> bool:
        return self.state is TrainingState.PRE_BACKWARD

    # --- forward ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self.state = TrainingState.FORWARD
        self.order_now = []
        self.cursor = [-1] * len(self.groups.members)
        self.opened = set()
        self.points = []
        self.regions = []
        self.replay, self.replayed = (None, None), set()
        self.generation += 1
        self._forget_hooked()

    def pre_forward(self, unit: U, grad: bool = False) -> tuple[int, int] | None:
        """`unit` is about to compute: its parameters must be there; the next one's may come.

        `grad`: a backward may follow (grad mode). Returns the token of the unit's
        post-backward point ([Note: lockstep]) for `post_backward`, or None.
        """
        self.grad = grad
        self._enter_groups(unit)
        return self._pre_forward(unit)

    def _pre_forward(self, unit: U) -> tuple[int, int] | None:
        unit.training_state = TrainingState.FORWARD
        self.order_now.append(unit)
        self._wait(unit)
        pos = len(self.order_now) - 1
        if (self.prefetch and self.order and pos < len(self.order)
                and self.order[pos] is unit and pos + 1 < len(self.order)):
            # (An order that changed this step: no guessing.)
            self._prefetch(self.order[pos + 1])
        return self._point("post", unit, self.grad)

    def _point(self, kind: str, unit: U, grad: bool) -> tuple[int, int] | None:
        if not grad:
            return None
        self.points.append((kind, unit))
        self.regions.append(self.region_of() if self.region_of is not None else None)
        return (self.generation, len(self.points) - 1)

    def post_forward(self, unit: U, hooked: bool = False,
                     grad: bool | None = None) -> tuple[int, int] | None:
        """`unit`'s forward is over. `hooked`: its outputs carry pre-backward hooks; `grad`
        (default: `hooked`): a backward may follow, so its pre-backward point is recorded,
        hooked or not ([Note: hooked agreement]). Returns the token of that point."""
        for g in self.groups.closes.get(id(unit), ()):
            self._close(g)
        return self._post_forward(unit, hooked, hooked if grad is None else grad)

    def _post_forward(self, unit: U, hooked: bool, grad: bool) -> tuple[int, int] | None:
        if unit.reshards_after_forward:
            self._reshard(unit)
        unit.training_state = TrainingState.IDLE
        return self._pre_point(unit, hooked, grad)

    def end_forward(self, backward_follows: bool) -> None:
        """The root's forward is over. Without a backward to come nothing stays gathered."""
        for g in range(len(self.cursor)):
            self._close(g)
        self.opened = set()
        self.reached = len(self.points)
        self._end_hooked()
        self.touched = False
        self.reduced = set()
        self.backward_started = False
        if [id(u) for u in self.order_now] != [id(u) for u in self.order]:
            self.order = list(self.order_now)
            self._index = {id(u): i for i, u in enumerate(self.order)}
        for u in self.units:
            # A prefetch nobody used, or (no backward) anything.
            if u.state is ShardedState.GATHERING or (
                    not backward_follows and u.state is not ShardedState.SHARDED):
                self._reshard(u)
        self.state = TrainingState.IDLE

    # --- backward -----------------------------------------------------------------------

    def pre_backward(self, unit: U, token: tuple[int, int] | None = None) -> None:
        """`unit`'s backward is about to run (once per gradient reaching its outputs)."""
        self._reach(token, "pre", unit)
        if not self._early(token):
            self._agreed()  # only the forward's last points run before ([Note: hooked agreement])
        self._pre_backward(unit)

    def _pre_backward(self, unit: U) -> None:
        self.state = TrainingState.PRE_BACKWARD
        unit.training_state = TrainingState.PRE_BACKWARD
        if _unshards_in_backward(unit):
            self._wait(unit)
        first, self.backward_started = not self.backward_started, True
        if not self.prefetch or not self.order:
            return
        i = self._index.get(id(unit))
        if i is not None and i > 0:
            nxt = self._needed_from(i - 1, 0)  # backward runs the forward order in reverse
        elif i == 0 and first and unit.is_root and len(self.order) > 1:
            # [Note: backward prefetch of the first block]
            nxt = self._needed_from(len(self.order) - 1, 1)
        else:
            return
        if nxt is not None and _unshards_in_backward(nxt):
            self._prefetch(nxt)

    def post_backward(self, unit: U, token: tuple[int, int] | None = None) -> None:
        """`unit`'s backward is over: hand its gradients on, then reshard."""
        self._reach(token, "post", unit)
        self._post_backward(unit)

    def _post_backward(self, unit: U) -> None:
        self._agreed()  # the freeze check, before any reduction ([Note: hooked agreement])
        self.reduced.add(id(unit))
        unit.training_state = TrainingState.POST_BACKWARD
        reductions = unit.reduce_grads()
        if reductions and self.log is not None:
            self.log.append(("reduce", unit))
        for pr in reductions:
            self.pending.append(pr)
            while len(self.pending) > self.limits.reduces:
                self._finish_oldest()
            self.most_reduces = max(self.most_reduces, len(self.pending))
        if unit.reshard_after_backward:
            self._reshard(unit)

    def end_backward(self) -> None:
        """After the whole backward: finish the units whose post-backward never ran (inputs
        that need no gradient), wait for every reduction, reshard everything."""
        if self.touched:
            # Only a backward through the recorded forward runs the points it skipped. One
            # through a unit called on its own since (a chunked loss's head) must leave them
            # to the forward's own backward: run here, they were spent, and that backward
            # then dropped the gradient of a unit it reached again (a tied embedding).
            self._reach_point(-1)
        # Units no recorded point covers (a forward outside grad mode, a recomputation):
        # reverse forward order is the order their post-backward would have run.
        seen = {id(u) for u in self.order}
        for u in list(reversed(self.order)) + [u for u in self.units if id(u) not in seen]:
            if id(u) in self.reduced:
                continue
            if u.state is not ShardedState.SHARDED or u.has_unreduced_grads():
                self._post_backward(u)
        while self.pending:
            self._finish_oldest()
        while self.releasing:
            self.releasing.popleft().release()
        for u in self.units:
            if u.reshard_after_backward:
                self._reshard(u)
            u.training_state = TrainingState.IDLE
        self.state = TrainingState.IDLE
        self.reduced = set()  # a second backward of the same graph starts afresh
        # Rounds a recomputation left open ([Note: recompute]) end with the backward.
        self.cursor = [-1] * len(self.cursor)
        self.opened = set()
        self.replay, self.replayed = (None, None), set()
        self.touched = False
        self.backward_started = False

    # --- prefetch -----------------------------------------------------------------------

    def _prefetch(self, unit: U) -> None:
        if unit.state is not ShardedState.SHARDED:
            return
        in_flight = sum(1 for u in self.units if u.state is ShardedState.GATHERING)
        if in_flight < self.limits.gathers:
            unit.unshard(async_op=True)
            if self.log is not None:
                self.log.append(("gather", unit))
            self.prefetches += 1
            self.most_gathers = max(self.most_gathers, in_flight + 1)


    # --- acting on a unit ([Note: decision log]) ----------------------------------------

    def _wait(self, unit: U) -> None:
        before = unit.state
        unit.wait_unshard()
        if self.log is not None:
            self._record(unit, before)

    def _reshard(self, unit: U) -> None:
        before = unit.state
        unit.reshard()
        if self.log is not None:
            self._record(unit, before)

    def _finish_oldest(self) -> None:
        pr = self.pending.popleft()
        pr.finish()
        while self.releasing:
            self.releasing.popleft().release()
        self.releasing.append(pr)
        if self.log is not None:
            self.log.append(("finish", pr.unit))

    def _record(self, unit: U, before: ShardedState) -> None:
        """Log the steps one call took `unit` through, around the cycle sharded -> gathering
        -> unsharded -> sharded: a wait on a sharded unit gathered first, a reshard of a
        gathering one waited first."""
        assert self.log is not None
        state = before
        while state is not unit.state:
            what, state = _STEPS[state]
            self.log.append((what, unit))


# [Note: decision log] Each state transition the schedule causes is one decision.
_STEPS = {ShardedState.SHARDED: ("gather", ShardedState.GATHERING),
          ShardedState.GATHERING: ("wait", ShardedState.UNSHARDED),
          ShardedState.UNSHARDED: ("reshard", ShardedState.SHARDED)}


def _unshards_in_backward(unit: ScheduledUnit) -> bool:
    """False for a unit whose backward needs no parameter values (set_unshard_in_backward)."""
    return getattr(unit, "unshard_in_backward", True)
