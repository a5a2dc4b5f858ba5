"""The step schedule: when each unit gathers, reshards and reduces. Decisions only.

This module holds no tensors and calls no collectives. It decides, and the units it is given
act. Two kinds of unit drive the same `Schedule`: the engine's `Unit` (real all-gathers and
reduce-scatters, engine/core/hooks.py) and the planner's byte-counting stand-in
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

[Note: backward prefetch of the first block] The root's pre-backward comes first in
backward, and the unit whose backward follows it is the last one forward ran. Nothing
prefetched that one, so its all-gather ran alone, exposed, while the root's own backward
(the head and the loss) could have covered it: the root's pre-backward prefetches it.

[Note: structure decides] Every rank issues the same collectives in the same order because
they follow from the module structure and the forward order alone, never from data: a unit
gathers when its forward (or its backward) reaches it, and the units whose post-backward did
not run (inputs that needed no gradient) reduce in the final callback, in reverse forward
order, as in FSDP2. Models whose data decides which units run (an expert that gets no token
on one rank) are brought back to the structure: the members of a container of units each
gather and reduce once per call of the module holding it, in the container's order, on
every rank ([Note: data-dependent units] in context.py, [Note: stand-ins] below).

[Note: stand-ins] A member of a container that this rank's call of the holder did not run
(an expert that got no token here) gets a *stand-in*: the calls its hooks would have made,
at the point in container order where it would have run (`stand_in`: pre_forward and
post_forward, or recompute). So the forward order recorded is the container's on every rank,
and so is everything decided from it (prefetch, the final callback's order). In backward the
stand-in owes what its hooks would have done: gather again (pre_backward) and reduce
(post_backward), its gradient None (the reduce buffer's flags then count no rank for it,
[Note: unused gradients] in unit.py). Each owed part is settled at the backward event that
would have followed it: backward runs forward in reverse, so with every forward event
numbered (a *tick*: `pre_forward` and `post_forward` each take the next), a unit's
pre-backward stands at its forward's last tick and its post-backward at its first, and an
owed part whose tick is later than the event's comes first (latest first). Whatever is still
owed at the final callback is settled there, the post-backward parts of stand-ins whose
holder's inputs needed no gradient in the reverse-order pass, where such units reduce.

[Note: coalesced units] Small units gather and reduce together: one all-gather for a run of
consecutive units of the recorded forward order whose gathered bytes fit the budget, and one
reduce-scatter for their gradients (DeepSpeed ZeRO-3's prefetch and reduce buckets; FSDP2
issues one of each per unit, however small). Each collective costs a fixed latency and host
work whatever its size, so for units of a few KiB that fixed part is the whole cost. A unit
says whether and with whom it may coalesce (`coalesce()`: a key that its neighbours must
share, its gathered bytes and its budget); the groups are cut from the recorded order when it
changes (`_cut_groups`), so they are the same on every rank ([Note: structure decides]), and
the first forward, which has no order yet, gathers unit by unit.
- Gather: when the schedule gathers a member (its forward or backward reaches it, or a
  prefetch), the group's members that are still sharded come in the same all-gather
  (`unshard(together=...)`, in group order). Each member copies its own columns out when it
  is waited for, and resharding stays per member, so a member's full parameters live as
  they would alone; the group's all-gather output lives until its last member was waited
  for (the planner replays this: planner/simulate.py). A prefetch looks past the group: the
  next unit after it in forward, the one before it in backward.
- Reduce: a member's post-backward packs its gradients into the group's reduce buffer
  (`open_batch` / `reduce_grads(batch)`) instead of reducing; the batch is issued as one
  reduce-scatter once every member packed, or at the first post-backward of a unit outside
  the group (or the same member again), or at the end of backward: points every rank
  reaches alike. A member that cannot pack now (inside no_sync) takes its own path.
The budget is per unit (`fully_shard(coalesce_bytes=...)`), 0 gathers alone; a group's sum
fits the smallest budget among its members.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar


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


class ScheduledUnit(Protocol):
    """What the schedule needs of a unit; core/unit.py and planner/simulate.py implement it."""

    state: ShardedState
    training_state: TrainingState
    reshard_after_forward: bool
    reshards_after_forward: bool  # this step: reshard_after_forward, with the root's rule
    reshard_after_backward: bool
    is_root: bool
    # Whether issuing its gather early gains anything: False where the gather is local work
    # (a one-rank shard group: nothing to overlap), done when it is waited for.
    prefetchable: bool

    def unshard(self, async_op: bool = True, together: Sequence[Any] = ()) -> None: ...
    def wait_unshard(self) -> None: ...
    def reshard(self) -> None: ...
    def reduce_grads(self, batch: Any = None) -> Sequence[PendingReduce]: ...
    def has_unreduced_grads(self) -> bool: ...
    def coalesce(self) -> Coalesce | None: ...
    def open_batch(self, members: Sequence[Any]) -> ReduceBatch: ...


@dataclass(frozen=True)
class Coalesce:
    """A unit's terms for sharing collectives with its neighbours ([Note: coalesced units])."""

    key: object  # what neighbours must share (group, dtypes, transport)
    nbytes: int  # its all-gather's output bytes
    budget: int  # the most bytes a group holding it may gather


class ReduceBatch(Protocol):
    """A group's gradients packed into one buffer, reduced by one collective."""

    def issue(self) -> Sequence[PendingReduce]:
        """Reduce what the members packed (nothing packed: no collective)."""
        ...


U = TypeVar("U", bound=ScheduledUnit)


@dataclass(eq=False)
class _Group(Generic[U]):
    members: list[U]
    key: object
    start: int  # the first and last member's places in the recorded order
    end: int


@dataclass(eq=False)
class _Batch(Generic[U]):
    group: _Group[U]
    handle: ReduceBatch
    packed: set[int] = field(default_factory=set)


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
        # Whether this backward has reached any unit yet ([Note: backward prefetch of the
        # first block]).
        self.backward_started = False
        # Statistics the tests and the planner read: prefetches issued, most in flight.
        self.prefetches = 0
        self.most_gathers = 0
        self.most_reduces = 0
        # The units whose all-gather was issued asynchronously (by a prefetch here, or by
        # `note_gathering`) and may still be in flight: a prefetch counts what is in flight
        # from these (at most `limits.gathers` and those the user issued) instead of
        # scanning every unit of the model at each prefetch (quadratic in the units).
        self._gathering: list[U] = []
        # Units whose gradients this backward reduced already (their post-backward ran).
        self.reduced: set[int] = set()
        # [Note: decision log] None: no log is kept (the engine's default; nothing is paid).
        self.log: list[tuple[str, U]] | None = None
        # [Note: stand-ins] Forward events numbered this step, and what stand-ins owe to
        # backward (empty unless a container member was skipped: nothing is paid).
        self.tick = 0
        self.owed: list[_Owed[U]] = []
        # [Note: coalesced units] id(unit) -> its group (cut from the recorded order), and
        # the group whose gradients are being packed in this backward.
        self.groups: dict[int, _Group[U]] = {}
        self._batch: _Batch[U] | None = None

    @property
    def in_backward(self) -> bool:
        return self.state is TrainingState.PRE_BACKWARD

    # --- forward ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self.state = TrainingState.FORWARD
        self.order_now = []
        self.tick = 0
        # Owed by a forward whose backward never came ([Note: stand-ins]).
        self.owed = []

    def pre_forward(self, unit: U) -> int:
        """`unit` is about to compute: its parameters must be there; the next one's may come.
        Returns this event's tick ([Note: stand-ins])."""
        unit.training_state = TrainingState.FORWARD
        self.order_now.append(unit)
        self._wait(unit)
        pos = len(self.order_now) - 1
        if (self.prefetch and self.order and pos < len(self.order)
                and self.order[pos] is unit):
            # (An order that changed this step: no guessing.)
            g = self.groups.get(id(unit)) if self.groups else None
            nxt = pos + 1 if g is None else g.end + 1  # past the group ([Note: coalesced units])
            if nxt < len(self.order):
                self._prefetch(self.order[nxt])
        self.tick += 1
        return self.tick

    def post_forward(self, unit: U) -> int:
        """`unit`'s forward is over. Returns this event's tick."""
        if unit.reshards_after_forward:
            self._reshard(unit)
        unit.training_state = TrainingState.IDLE
        self.tick += 1
        return self.tick

    def stand_in(self, calls: Sequence[tuple[U, bool, bool]], late: bool) -> None:
        """A container member its holder's call did not run here ([Note: stand-ins]): the
        schedule calls a call of it would make. `calls`: (unit, True) at each unit's
        pre-forward and (unit, False) after its forward, nested units inside, with whether
        its backward is owed (grad mode, and a gradient could reach it); `late`: the owed
        post-backward waits for the final callback (the holder's inputs needed no gradient)."""
        if self.state is TrainingState.PRE_BACKWARD:
            for unit, pre, _ in calls:  # activation checkpointing recomputes the holder
                if pre:
                    self.recompute(unit)
            return
        open_: list[tuple[int, int]] = []
        for unit, pre, owes in calls:
            if pre:
                open_.append((len(self.order_now), self.pre_forward(unit)))
                continue
            index, start = open_.pop()
            end = self.post_forward(unit)
            if owes:
                self.owed.append(_Owed(unit, index, start, end, late))

    def end_forward(self, backward_follows: bool) -> None:
        """The root's forward is over. Without a backward to come nothing stays gathered."""
        self.reduced = set()
        self.backward_started = False
        if [id(u) for u in self.order_now] != [id(u) for u in self.order]:
            self.order = list(self.order_now)
            self._index = {id(u): i for i, u in enumerate(self.order)}
            self.groups = _cut_groups(self.order)
        for u in self.units:
            # A prefetch nobody used, or (no backward) anything.
            if u.state is ShardedState.GATHERING or (
                    not backward_follows and u.state is not ShardedState.SHARDED):
                self._reshard(u)
        if not backward_follows:
            self.owed = []
        self.state = TrainingState.IDLE

    # --- backward -----------------------------------------------------------------------

    def recompute(self, unit: U) -> None:
        """`unit`'s forward runs again inside backward (activation checkpointing)."""
        self._wait(unit)

    def pre_backward(self, unit: U, at: int | None = None) -> None:
        """`unit`'s backward is about to run (once per gradient reaching its outputs);
        `at`: the tick its forward ended on (None: settle everything owed first)."""
        if self.owed:
            self._settle(at)
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
        g = self.groups.get(id(unit)) if self.groups and i is not None else None
        if g is not None:
            i = g.start  # the prefetch looks past the group ([Note: coalesced units])
        if i is not None and i > 0:
            nxt = self.order[i - 1]  # backward runs the forward order in reverse
        elif i == 0 and first and unit.is_root and len(self.order) > 1:
            # [Note: backward prefetch of the first block]
            nxt = self.order[-1]
        else:
            return
        if _unshards_in_backward(nxt):
            self._prefetch(nxt)

    def post_backward(self, unit: U, at: int | None = None) -> None:
        """`unit`'s backward is over: hand its gradients on, then reshard. `at`: the tick
        its forward started on (None: settle everything owed first)."""
        if self.owed:
            self._settle(at)
        self._post_backward(unit)

    def _post_backward(self, unit: U) -> None:
        self.reduced.add(id(unit))
        unit.training_state = TrainingState.POST_BACKWARD
        g = self.groups.get(id(unit)) if self.groups else None
        b = self._batch
        if b is not None and (b.group is not g or id(unit) in b.packed):
            self._issue_batch()  # [Note: coalesced units]: the group's run is over
            b = None
        if g is not None and unit.coalesce() is not None:
            if b is None:
                b = self._batch = _Batch(g, unit.open_batch(g.members))
            b.packed.add(id(unit))
            reductions = unit.reduce_grads(b.handle)
            if len(b.packed) == len(g.members):
                self._issue_batch()
        else:
            reductions = unit.reduce_grads()
        if reductions and self.log is not None:
            self.log.append(("reduce", unit))
        self._add_pending(reductions)
        if unit.reshard_after_backward:
            self._reshard(unit)

    def _add_pending(self, reductions: Sequence[PendingReduce]) -> None:
        for pr in reductions:
            self.pending.append(pr)
            while len(self.pending) > self.limits.reduces:
                self._finish_oldest()
            self.most_reduces = max(self.most_reduces, len(self.pending))

    def _issue_batch(self) -> None:
        b, self._batch = self._batch, None
        assert b is not None
        reductions = b.handle.issue()
        if self.log is not None:
            # One entry per member whose gradients it carries, as if each reduced alone.
            for pr in reductions:
                self.log.extend(("reduce", u) for u in getattr(pr, "units", (pr.unit,)))
        self._add_pending(reductions)

    def end_backward(self) -> None:
        """After the whole backward: finish the units whose post-backward never ran (inputs
        that need no gradient), wait for every reduction, reshard everything."""
        # [Note: stand-ins] What is still owed: every pre-backward part (each unit's hooks
        # ran before this callback), the post-backward parts but the late ones.
        if self.owed:
            self._settle(None)
        late = {o.index: o for o in self.owed}
        self.owed = []
        # Reverse forward order is the order their post-backward would have run; the same
        # on every rank ([Note: structure decides]).
        seen = {id(u) for u in self.order}
        n = len(self.order)
        for i, u in [*reversed(list(enumerate(self.order))),
                     *((n, u) for u in self.units if id(u) not in seen)]:
            if (o := late.pop(i, None)) is not None:
                self._post_backward(o.unit)
                continue
            if id(u) in self.reduced and u.training_state is TrainingState.POST_BACKWARD:
                # Reduced, and no backward reached it since. One that did (a tied weight's
                # second call, an embedding whose inputs need no gradient, after its head's
                # post-backward) reduces again here: its new gradients add up (FSDP2 too).
                continue
            if u.state is not ShardedState.SHARDED or u.has_unreduced_grads():
                self._post_backward(u)
        if self._batch is not None:
            self._issue_batch()
        while self.pending:
            self._finish_oldest()
        for u in self.units:
            if u.reshard_after_backward:
                self._reshard(u)
            u.training_state = TrainingState.IDLE
        self.state = TrainingState.IDLE
        self.reduced = set()  # a second backward of the same graph starts afresh
        self.backward_started = False

    def _settle(self, at: int | None) -> None:
        """Do the owed parts whose ticks come after `at` (all: None), the latest first
        ([Note: stand-ins]); the late post-backward parts wait for the final callback."""
        parts = [(o.end, True, o) for o in self.owed if o.pre and (at is None or o.end > at)]
        parts += [(o.start, False, o) for o in self.owed
                  if not o.late and (at is None or o.start > at)]
        if not parts:
            return
        for _, pre, o in sorted(parts, key=lambda x: -x[0]):
            if pre:
                o.pre = False
                self._pre_backward(o.unit)
            else:
                self.owed.remove(o)
                self._post_backward(o.unit)

    # --- prefetch -----------------------------------------------------------------------

    def note_gathering(self, unit: U) -> None:
        """`unit`'s all-gather was issued asynchronously outside a prefetch (FSDP2's
        `module.unshard(async_op=True)`): it counts against `limits.gathers` until waited."""
        self._gathering.append(unit)

    def _prefetch(self, unit: U) -> None:
        if unit.state is not ShardedState.SHARDED or not unit.prefetchable:
            return
        self._gathering = [u for u in self._gathering if u.state is ShardedState.GATHERING]
        in_flight = len(self._gathering)
        if in_flight < self.limits.gathers:
            self._gather(unit, self._together(unit))
            self._gathering.append(unit)
            self.prefetches += 1
            self.most_gathers = max(self.most_gathers, in_flight + 1)


    # --- acting on a unit ([Note: decision log]) ----------------------------------------

    def _together(self, unit: U) -> Sequence[U]:
        """The members of `unit`'s group that gather with it now: those still sharded and
        still on the group's terms, in group order (none: `unit` gathers alone)."""
        g = self.groups.get(id(unit)) if self.groups else None
        if g is None or self.state is TrainingState.IDLE:
            return ()
        backward = self.state is TrainingState.PRE_BACKWARD
        members = [m for m in g.members if m.state is ShardedState.SHARDED
                   and (c := m.coalesce()) is not None and c.key == g.key
                   and not (backward and not _unshards_in_backward(m))]
        return members if len(members) > 1 and unit in members else ()

    def _gather(self, unit: U, together: Sequence[U]) -> None:
        unit.unshard(async_op=True, together=together)
        if self.log is not None:
            for m in together or (unit,):
                self.log.append(("gather", m))

    def _wait(self, unit: U) -> None:
        before = unit.state
        if before is ShardedState.SHARDED and self.groups:
            together = self._together(unit)
            if together:
                self._gather(unit, together)
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


@dataclass(eq=False)
class _Owed(Generic[U]):
    """What a stand-in owes to backward ([Note: stand-ins])."""

    unit: U
    index: int  # its place in the step's forward order
    start: int  # the ticks of its stand-in pre_forward and post_forward
    end: int
    late: bool  # its post-backward part waits for the final callback's pass
    pre: bool = True  # its pre-backward part is still owed


def _cut_groups(order: Sequence[U]) -> dict[int, _Group[U]]:
    """[Note: coalesced units] Runs of consecutive units of the forward order that share a
    key and whose gathered bytes fit the smallest budget among them. A unit that runs more
    than once per step (a tied module, a unit called twice) stays alone: its places in the
    order are not one."""
    seen: dict[int, int] = {}
    for u in order:
        seen[id(u)] = seen.get(id(u), 0) + 1
    groups: dict[int, _Group[U]] = {}
    run: list[U] = []
    run_start, total, budget, key = 0, 0, 0, None

    def close() -> None:
        if len(run) > 1:
            g = _Group(list(run), key, run_start, run_start + len(run) - 1)
            for m in run:
                groups[id(m)] = g
        run.clear()

    for i, u in enumerate(order):
        c = u.coalesce() if seen[id(u)] == 1 else None
        if c is None or c.budget <= 0 or c.nbytes > c.budget:
            close()
            continue
        if run and c.key == key and total + c.nbytes <= min(budget, c.budget):
            run.append(u)
            total += c.nbytes
            budget = min(budget, c.budget)
            continue
        close()
        run.append(u)
        run_start, total, budget, key = i, c.nbytes, c.budget, c.key
    close()
    return groups


def _unshards_in_backward(unit: ScheduledUnit) -> bool:
    """False for a unit whose backward needs no parameter values (set_unshard_in_backward)."""
    return getattr(unit, "unshard_in_backward", True)
