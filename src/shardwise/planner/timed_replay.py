"""The time model's replay of a step: the engine's own `Schedule` over clock-keeping units.

As the memory replay (simulate.py) counts bytes, this replay keeps two clocks: the compute
stream (`comp`: the training thread) and the communication stream (`comm`: collectives run
one after another in issue order). The units are replay.py's `ReplayUnit`s and the step is
replay.py's walk, so prefetching, the in-flight limits (`Limits`), resharding and the reduce
drain are the engine's decisions (engine/core/schedule.py), not a copy of them. The schedule logs
every decision in order ([Note: decision log]: `Replay.log`); `Replay.timeline` is when the
communication stream ran each collective. tests/dist/test_schedule.py holds both against the
engine's own log.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.core.schedule import DEFAULT_LIMITS, Coalesce, Limits, Schedule
from .replay import ReplayUnit, replay_backward, replay_forward


class _Reduce:
    def __init__(self, unit: _TimedUnit, done: float) -> None:
        self.unit, self.done, self.finished = unit, done, False
        self.units = [unit]  # a group's: every member ([Note: coalesced units])

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        r = self.unit.replay
        r.comp = max(r.comp, self.done)
        r.copy("reduce_sum", self.unit.i)
        r.copy("reduce_out", self.unit.i)
        if r.sync_all_reduce:  # HYBRID: the replica all-reduce runs on the training thread
            r.comp = r.issue("all_reduce", self.unit.i, r.comp)

    def release(self) -> None:
        """The peer read what was sent: by the next finish it has (no time of its own)."""


class _TimedUnit(ReplayUnit):
    """A unit that keeps time: its all-gather is done at `ready`."""

    def __init__(self, replay: Replay, i: int, reshard_after_forward: bool) -> None:
        super().__init__(i, reshard_after_forward)
        self.replay = replay
        self.ready = 0.0

    def _issue_gather(self) -> None:
        r = self.replay
        r.copy("gather_in", self.i)
        self.ready = r.issue("all_gather", self.i, r.comp)

    def _gathered(self) -> None:
        r = self.replay
        r.comp = max(r.comp, self.ready)
        r.copy("gather_out", self.i)

    def _issue_group_gather(self, members: Sequence[ReplayUnit]) -> None:
        """One all-gather for the group ([Note: coalesced units]): the members' transfer
        times add up, their fixed latencies are paid once."""
        r = self.replay
        for m in members:
            r.copy("gather_in", m.i)
        ready = r.issue_group("all_gather", [m.i for m in members], r.comp)
        for m in members:
            m.ready = ready  # type: ignore[attr-defined]

    def open_batch(self, members: Sequence[ReplayUnit]) -> _TimedBatch:
        return _TimedBatch(self.replay)

    def _freed(self) -> None:
        pass  # resharding frees memory; it takes no time worth counting

    def _issue_reduce(self) -> Sequence[_Reduce]:
        r = self.replay
        r.copy("pack", self.i)
        done = r.issue("reduce_scatter", self.i, r.comp)
        if not r.sync_all_reduce:
            done = r.issue("all_reduce", self.i, done)
        return (_Reduce(self, done),)


class _TimedBatch:
    """A group's reduce-scatter: packed member by member, issued once."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        self.packed: list[_TimedUnit] = []

    def pack(self, unit: _TimedUnit) -> None:
        self.replay.copy("pack", unit.i)
        self.packed.append(unit)

    def issue(self) -> Sequence[_Reduce]:
        if not self.packed:
            return ()
        r = self.replay
        done = r.issue_group("reduce_scatter", [u.i for u in self.packed], r.comp)
        pr = _Reduce(self.packed[0], done)
        pr.units = list(self.packed)
        return (pr,)


class Replay:
    """Two steps of the engine's schedule; the second (prefetching, as in training) is timed.

    `seconds(kind, unit, phase)`: how long that unit's collectives of `kind` take in `phase`
    ("forward" | "backward"); 0 where there are none. `forward_s` / `backward_s`: compute per
    unit (index 0 is the root: its own work runs after the blocks in forward, half of its
    backward before them, half after). `copy_s(kind, unit)`: seconds of one of the unit's
    local copies of `kind` (planner/copies.py's keys), on the training thread where the
    engine makes it: copy-in as a gather is issued, copy-out when it is waited for, the
    pack as a reduction is issued, the sum and casts when it finishes. `overlap=False`: a
    collective runs on the training thread's cores (a CPU running gloo), so the compute
    clock pays its `seconds` as it is issued, and it completes `wire(kind, unit, phase)`
    later (its wall-clock time, at least its work; in issue order): a wait right after an
    issue waits for it, one after other work does not.
    """

    def __init__(self, forward_s: Sequence[float], backward_s: Sequence[float],
                 seconds: Callable[[str, int, str], float], *, reshard_after_forward: bool,
                 sync_all_reduce: bool, limits: Limits = DEFAULT_LIMITS,
                 copy_s: Callable[[str, int], float] | None = None,
                 overlap: bool = True,
                 wire: Callable[[str, int, str], float] | None = None,
                 terms: Sequence[Coalesce | None] | None = None,
                 fixed: Callable[[str, int, str], float] | None = None) -> None:
        self.fwd, self.bwd, self.seconds = forward_s, backward_s, seconds
        self.copy_s = copy_s
        self.overlap = overlap
        self.wire = wire
        self.sync_all_reduce = sync_all_reduce
        self.units = [_TimedUnit(self, i, reshard_after_forward) for i in range(len(forward_s))]
        # [Note: coalesced units]: each unit's terms, and the fixed part (latency) of a
        # unit's collective, which a group pays once.
        for u, t in zip(self.units, terms or ()):
            u.terms = t
        self.fixed = fixed
        self.schedule: Schedule[_TimedUnit] = Schedule(self.units, limits)
        self.schedule.log = []
        self.comp = self.comm = 0.0
        self.phase = "forward"
        # (kind, unit, start, end) of each collective the communication stream ran.
        self.timeline: list[tuple[str, int, float, float]] = []

    @property
    def log(self) -> list[tuple[str, int]]:
        """The schedule's decisions in order, units by index."""
        return [(what, u.i) for what, u in self.schedule.log or ()]

    def issue(self, kind: str, unit: int, at: float) -> float:
        return self.issue_group(kind, [unit], at)

    def issue_group(self, kind: str, units: list[int], at: float) -> float:
        """One collective for several units' buffers: their times less all but one fixed
        latency. The timeline names each member, as the schedule's log does (one entry
        each, the same interval)."""
        def total(f: Callable[[str, int, str], float] | None) -> float | None:
            return None if f is None else sum(f(kind, u, self.phase) for u in units)

        fixed = ([self.fixed(kind, u, self.phase) for u in units]
                 if self.fixed is not None else [0.0])
        saved = sum(fixed) - max(fixed)
        d = (total(self.seconds) or 0.0) - saved
        if d <= 0:
            return at
        start = max(self.comm, at)
        if self.overlap:
            self.comm = start + d
        else:
            self.comp = max(self.comp, at) + d  # the cores do its work now
            w = total(self.wire)
            self.comm = max(start + (d if w is None else w - saved), self.comp)
        for u in units:
            self.timeline.append((kind, u, start, self.comm))
        return self.comm

    def copy(self, kind: str, unit: int) -> None:
        if self.copy_s is not None:
            self.comp += self.copy_s(kind, unit)

    # --- the step's work between the schedule's calls (replay.py's `StepWork`) -------------

    def forward(self, unit: ReplayUnit) -> None:
        if not unit.is_root:
            self.comp += self.fwd[unit.i]

    def head_forward(self) -> None:
        self.comp += self.fwd[0]  # the root's own work: embedding, head and loss

    def head_backward(self) -> None:
        self.comp += self.bwd[0] / 2  # loss and head

    def backward(self, unit: ReplayUnit) -> None:
        self.comp += self.bwd[unit.i]

    def root_backward(self) -> None:
        self.comp += self.bwd[0] / 2  # the embedding's gradient comes last

    def _step(self) -> None:
        self.phase = "forward"
        replay_forward(self.schedule, self)
        self.phase = "backward"
        replay_backward(self.schedule, self)

    def step_seconds(self) -> float:
        """Seconds of the second step's forward and backward (the first records the order)."""
        self._step()
        self.comp = self.comm = 0.0
        self.timeline.clear()
        self.schedule.log = []
        self._step()
        return self.comp
