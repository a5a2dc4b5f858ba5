"""How the schedule keeps every rank's collectives in step when data decides what runs.

`LockstepRules` is part of `Schedule` (schedule.py): the group rounds of the forward, the
visits of skipped members, and the recomputation of activation-checkpointed regions. It
uses the schedule's state (groups, cursor, recorded points) and its steps (`_pre_forward`,
`_wait`, `_pre_backward`, ...), and decides nothing else.

[Note: lockstep] Every rank must issue the same collectives in the same order, but what a
rank's data does decides which units run (a mixture-of-experts rank that routes no token to
an expert never calls it) and which get a gradient (an output unused by this rank's loss).
Two rules make the collectives independent of the data:

- Forward: the units that are the children of one `nn.ModuleList`/`ModuleDict` (a *group*,
  engine/lockstep.py) run in container order. When a member is called, the members before it
  that this rank skipped are *visited* first: gathered, resharded and recorded exactly as if
  they had run on no input; the rest are visited when the group is left (a unit outside the
  container starts, the unit holding the container ends its forward, or the forward ends).
  One call of the group's holder (the module holding the container) is one round: a rank
  that called no member in it visits them all when the holder returns.
- Backward: the forward records where each unit's pre-backward (its outputs) and
  post-backward (its inputs) would come, in order, for every call in grad mode, whether or
  not this rank's outputs got a hook ([Note: hooked agreement]). Autograd runs nodes in
  reverse creation order, so backward meets those points in exactly the reverse order,
  skipping the ones that got no gradient on this rank. Reaching a point, the schedule first
  runs the skipped points after it, and the final callback runs the rest: every rank gathers
  and reduces every unit at the same place in the sequence; a unit with no gradient here
  reduces zeros flagged as absent ([Note: unused gradients] in unit.py), so it reduces in
  lockstep. A pre-backward point that no rank hooked is dropped on every rank.

[Note: hooked agreement] Whether a gradient can reach a unit's outputs is data too: a unit
whose parameters only some ranks' data uses hands its input on unchanged elsewhere, an
output that needs no gradient there. Recorded only where hooked, its pre-backward point
(its gather for backward) ran on those ranks alone, and every collective after it differed:
a hang. Recorded on every grad-enabled call, it cost a backward gather for units that no
rank needs in backward (a frozen bottom stack whose inputs need no gradient). So the point
is recorded on every call, with whether this rank hooked it, and the ranks agree per unit
whether any of them did: each rank's flags (`hooked`, complete when the root's forward
ends) ride in the freeze check's all-reduce (a MAX, so an OR; freeze_check.py), issued at
the first backward hook. (Not at the forward's end: a forward that no backward follows left
it in flight, and a rank that ended right after one waited at exit for its peer's half.) A unit
hooked on no rank has its pre-backward points dropped (no gather, no prefetch of it); one
hooked elsewhere runs them here as skipped points. A member that the group rounds visited
is not hooked here: an expert that no rank sent a token is not gathered in backward either.
Per unit, not per point, so that the flags have one size on every rank whatever the calls:
a unit called twice and hooked on one call runs both calls' points.

The answer is waited for when first needed (`_agreed`), so that the all-reduce overlaps the
backward of the head and the last block: before every step the schedule takes in
backward except the runs of the forward's *last points*. Those are the last point (the
root's pre-backward, which prefetches the last block) and the pre-backward points just
before it, back to the last post-backward point (the last block's, and those of units that
enclose it), of units that the last agreement settled found hooked; the same on every rank,
as that agreement is. They always run, hooked or not (a unit that stopped being hooked
costs one gather, for one step), by their own hooks or as skipped points, and their
prefetches follow that last agreement. So every rank has issued the same collectives when
it waits, and what the wait issues itself (the freeze check's account of a mismatch, a
mesh's further dims) comes at the same place in every rank's sequence. Waiting wherever a
rank first needed it, a rank that ran a gather hooked there alone before waiting was left
in it by the others raising the freeze check's error. The wait precedes every reduction,
as the freeze check requires. The first backward has no last agreement: only the root's
point runs before the wait. Without an agreement (one rank, no unit reducing over more than
one: no collective could differ) this rank's own flags decide and predict nothing. The
planner's replays record no points: their decisions are unchanged. Not covered: a forward
before the last one, whose hooks act alone ([Note: lockstep]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

U = TypeVar("U")


class LockstepRules(Generic[U]):
    """The [Note: lockstep] and [Note: recompute] rules of `Schedule`."""

    # Set by Schedule.__init__ (see there).
    units: list[U]
    order: list[U]
    groups: Any
    cursor: list[int]
    opened: set[int]
    points: list[tuple[str, U]]
    regions: list[object]
    region_of: Any
    replay: tuple[object, object]
    replayed: set[object]
    reached: int
    generation: int
    touched: bool
    grad: bool
    in_backward: bool
    settle: Callable[[], None] | None

    def _enter_groups(self, unit: U) -> None:
        if not self.cursor:
            return
        inside = self.groups.inside.get(id(unit), frozenset())
        for g, at in enumerate(self.cursor):
            if at >= 0 and g not in inside:
                self._close(g)  # left the group's container: visit the members it skipped
        member = self.groups.member_of.get(id(unit))
        if member is None:
            return
        g, k = member
        self.opened.discard(g)
        if k <= self.cursor[g]:
            self._close(g)  # the container runs again (a second call): a new round
        for j in range(self.cursor[g] + 1, k):
            self._visit(self.groups.members[g][j])
        self.cursor[g] = k

    def _close(self, g: int) -> None:
        if self.cursor[g] < 0:
            return  # not entered in this round
        members = self.groups.members[g]
        for j in range(self.cursor[g] + 1, len(members)):
            self._visit(members[j])
        self.cursor[g] = -1

    def _visit(self, unit: U) -> None:
        """What a member this rank skipped does on the others: gather, reshard, record."""
        if self.in_backward:
            # [Note: recompute]: gathered as where it is recomputed, and kept for its backward.
            self._enter_region(unit)
            self._agreed()
            self._wait(unit)
            return
        self._pre_forward(unit)
        self._post_forward(unit, hooked=False, grad=self.grad)  # [Note: hooked agreement]

    def open_groups(self, gs: Sequence[int]) -> None:
        """The holder of groups `gs` (engine/lockstep.py) starts its forward: a new round."""
        for g in gs:
            self._close(g)
            if self.in_backward:
                # [Note: recompute]: every member now, as the recomputation may stop early.
                for u in self.groups.members[g]:
                    self._visit(u)
            else:
                self.opened.add(g)

    def close_groups(self, gs: Sequence[int]) -> None:
        """The holder's forward is over: visit the members this round skipped; all of them
        when this rank called none (every rank visits or calls each member once a round)."""
        for g in gs:
            if g in self.opened:
                self.opened.discard(g)
                for u in self.groups.members[g]:
                    self._visit(u)
            else:
                self._close(g)

    # [Note: recompute] Activation checkpointing re-runs a region's forward inside backward,
    # and the units it calls need their parameters then. Which members of a group a rank
    # calls is its data's choice, so when a group's holder runs again, every member is
    # gathered, in container order, on every rank, and kept for its backward, whose
    # pre-backward point then finds it gathered everywhere. All of them at once: torch's
    # checkpoint stops recomputing once the last saved tensor is made again, which on a rank
    # that skips the last experts is before the holder returns. Those gathers must come at
    # the same place in every rank's sequence, but a rank may not yet have run the points
    # recorded after the region that it skipped (an expert of a later layer it sent no
    # token): the forward records which checkpointed region each point lies in, and before
    # a recomputation gathers anything, the skipped points after its region are run.
    # Not covered (docs/moe.md): a region recomputed on some ranks only (nothing in it
    # needs a gradient on the others), and reentrant checkpointing.

    def recompute(self, unit: U) -> None:
        """`unit`'s forward runs again inside backward ([Note: recompute]). No group rounds:
        the holder gathered every member already, and one a recomputation stopped early
        left open would be closed by the next."""
        self._enter_region(unit)
        self._agreed()
        self._wait(unit)

    def _enter_region(self, unit: U) -> None:
        """Run the skipped points recorded after the checkpointed region being recomputed
        ([Note: recompute]): the one of `unit`'s calls this recomputation replays."""
        now = self.region_of() if self.region_of is not None else None
        if now != self.replay[0]:
            self.replay = (now, None)  # another recomputation: it replays another region
        calls = [p for p in range(min(self.reached, len(self.points)) - 1, -1, -1)
                 if self.points[p] == ("post", unit) and self.regions[p] is not None]
        # A call in the region this recomputation replays, else in the latest region not
        # replayed yet (regions are recomputed in reverse order; a later call of `unit` that
        # got no gradient here is still below `reached`).
        start = next((p for p in calls if self.regions[p] == self.replay[1]), None)
        if start is None:
            start = next((p for p in calls if self.regions[p] not in self.replayed), None)
        if start is None:
            return  # not recorded in a region: nothing to line up
        key = self.regions[start]
        self.replay = (now, key)
        self.replayed.add(key)
        end = max(p for p in range(start, len(self.points)) if self.regions[p] == key)
        self._run_points_after(end)

    # --- backward through the recorded points ------------------------------------------

    def _reach(self, token: tuple[int, int] | None, kind: str, unit: U) -> None:
        """Backward reached a recorded point: first run the later points it skipped."""
        if token is None or token[0] != self.generation:
            return  # a forward before the last one, or not recorded: act on it alone
        pos = token[1]
        if pos < self.reached and self.points[pos] == (kind, unit):
            self.touched = True
            self._reach_point(pos)

    def _reach_point(self, pos: int) -> None:
        self._run_points_after(pos)
        self.reached = max(pos, 0)

    def _run_points_after(self, pos: int) -> None:
        """Run the recorded points after `pos` that backward has not reached, latest first;
        a pre-backward point only if some rank hooked its unit, or if it is one of the
        forward's last points, which always run ([Note: hooked agreement])."""
        while self.reached - 1 > pos:
            self.reached -= 1
            kind, u = self.points[self.reached]
            if kind == "post":
                self._post_backward(u)
            elif self.reached >= self.early or id(u) in self._agreed():
                self._pre_backward(u)

    # --- [Note: hooked agreement] -------------------------------------------------------

    # The agreement last settled (the same on every rank): what backward expects before this
    # forward's is in. None: none yet, or nothing to agree.
    predicted: frozenset[int] | None = None

    def _forget_hooked(self) -> None:
        """A forward starts: nothing hooked yet, nothing to agree."""
        self.here: set[int] = set()  # units with a hooked pre-backward point on this rank
        self.hooked: list[bool] = []  # per unit of `units`: what this rank contributes
        self.called: frozenset[int] = frozenset()  # units with a pre-backward point
        self.anywhere: frozenset[int] | None = frozenset()  # hooked on some rank
        # The forward's last points, `early` to `last`: run before the answer, on every rank.
        self.early, self.last = 0, -1

    def _pre_point(self, unit: U, hooked: bool, grad: bool) -> tuple[int, int] | None:
        token = self._point("pre", unit, hooked or grad)
        if hooked and token is not None:
            self.here.add(id(unit))
        return token

    def _end_hooked(self) -> None:
        """The root's forward is over (`reached` set): this rank's flags, and the points
        that run before the answer: the last one, and the pre-backward points before it
        (back to the last post-backward point) of units the last agreement found hooked."""
        self.last = early = self.reached - 1
        if early >= 0 and self.points[early][0] == "post":
            early += 1  # a reduction never runs before the answer
        while early > 0 and self.predicted is not None and (
                self.points[early - 1][0] == "pre"
                and id(self.points[early - 1][1]) in self.predicted):
            early -= 1
        self.early = early
        self.called = frozenset(id(u) for kind, u in self.points if kind == "pre")
        self.hooked = [id(u) in self.here for u in self.units]
        self.anywhere = None

    def agree(self, anywhere: Sequence[int] | None) -> None:
        """Per unit of `units`, whether some rank hooked it (every rank's `hooked`, OR-ed),
        kept as the next forward's prediction; None: nothing to agree, this rank's own
        flags decide (and predict nothing: another rank's may differ)."""
        if anywhere is None:
            self.anywhere = frozenset(id(u) for u, f in zip(self.units, self.hooked) if f)
            return
        self.anywhere = frozenset(id(u) for u, f in zip(self.units, anywhere) if f)
        self.predicted = self.anywhere

    def _agreed(self) -> frozenset[int]:
        """The units hooked on some rank, waiting for the answer if it is not in yet."""
        if self.anywhere is None and self.settle is not None:
            self.settle()  # the engine's: waits for the all-reduce, calls `agree`
        if self.anywhere is None:
            self.agree(None)
        assert self.anywhere is not None
        return self.anywhere

    def _early(self, token: tuple[int, int] | None) -> bool:
        """`token` is one of this forward's last points, which run before the answer."""
        return (token is not None and token[0] == self.generation
                and self.early <= token[1] <= self.last)

    def _needed_from(self, j: int, stop: int) -> U | None:
        """The unit whose gather backward needs next: `order[j]`, or the latest before it
        (down to `stop`) whose pre-backward points were not dropped: as the answer says,
        or, among the forward's last points (before it is in), as the last one said."""
        known = self.predicted if self.reached >= self.early else self.anywhere
        while j >= stop and known is not None and (
                id(self.order[j]) in self.called and id(self.order[j]) not in known):
            j -= 1
        return self.order[j] if j >= stop else None

    # The schedule's own steps (schedule.py).
    def _point(self, kind: str, unit: U, grad: bool) -> tuple[int, int] | None: ...
    def _pre_forward(self, unit: U) -> Any: ...
    def _post_forward(self, unit: U, hooked: bool, grad: bool) -> Any: ...
    def _pre_backward(self, unit: U) -> None: ...
    def _post_backward(self, unit: U) -> None: ...
    def _wait(self, unit: U) -> None: ...
