"""The time model's replay of a step: the engine's own `Schedule` over clock-keeping units.

As the memory replay (simulate.py) counts bytes, this replay keeps two clocks: the compute
stream (`comp`: the training thread) and the communication stream (`comm`: collectives run
one after another in issue order). The units implement the schedule's `ScheduledUnit`
protocol, so prefetching, the in-flight limits (`Limits`), resharding and the reduce drain are
the engine's decisions (engine/schedule.py), not a copy of them. Every decision is logged in
order (`Replay.log`), which is what the tests compare with the memory replay and the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.schedule import DEFAULT_LIMITS, Limits, Schedule, ShardedState, TrainingState


class _Reduce:
    def __init__(self, unit: _TimedUnit, done: float) -> None:
        self.unit, self.done, self.finished = unit, done, False

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        r = self.unit.replay
        r.comp = max(r.comp, self.done)
        if r.sync_all_reduce:  # HYBRID: the replica all-reduce runs on the training thread
            r.comp = r.issue("all_reduce", self.unit.i, r.comp)
        r.log.append(("finish", self.unit.i))


class _TimedUnit:
    def __init__(self, replay: Replay, i: int, reshard_after_forward: bool) -> None:
        self.replay, self.i = replay, i
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.is_root = i == 0
        self.reshard_after_forward = reshard_after_forward
        # shard_model's rule (FSDP2's reshard_after_forward=None): the root keeps its own.
        self.reshards_after_forward = reshard_after_forward and not self.is_root
        self.reshard_after_backward = True
        self.ready = 0.0  # when this unit's all-gather completes
        self.unreduced = False

    def unshard(self, async_op: bool = True) -> None:
        if self.state is not ShardedState.SHARDED:
            return
        r = self.replay
        self.ready = r.issue("all_gather", self.i, r.comp)
        r.log.append(("gather", self.i))
        self.state = ShardedState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is ShardedState.UNSHARDED:
            return
        self.unshard()
        r = self.replay
        r.comp = max(r.comp, self.ready)
        r.log.append(("wait", self.i))
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        if self.state is ShardedState.SHARDED:
            return
        self.wait_unshard()
        self.replay.log.append(("reshard", self.i))
        self.state = ShardedState.SHARDED

    def has_unreduced_grads(self) -> bool:
        return self.unreduced

    def reduce_grads(self) -> Sequence[_Reduce]:
        self.unreduced = False
        r = self.replay
        done = r.issue("reduce_scatter", self.i, r.comp)
        if not r.sync_all_reduce:
            done = r.issue("all_reduce", self.i, done)
        r.log.append(("reduce", self.i))
        return (_Reduce(self, done),)


class Replay:
    """Two steps of the engine's schedule; the second (prefetching, as in training) is timed.

    `seconds(kind, unit, phase)`: how long that unit's collectives of `kind` take in `phase`
    ("forward" | "backward"); 0 where there are none. `forward_s` / `backward_s`: compute per
    unit (index 0 is the root: its own work runs after the blocks in forward, half of its
    backward before them, half after).
    """

    def __init__(self, forward_s: Sequence[float], backward_s: Sequence[float],
                 seconds: Callable[[str, int, str], float], *, reshard_after_forward: bool,
                 sync_all_reduce: bool, limits: Limits = DEFAULT_LIMITS) -> None:
        self.fwd, self.bwd, self.seconds = forward_s, backward_s, seconds
        self.sync_all_reduce = sync_all_reduce
        self.units = [_TimedUnit(self, i, reshard_after_forward) for i in range(len(forward_s))]
        self.schedule: Schedule[_TimedUnit] = Schedule(self.units, limits)
        self.comp = self.comm = 0.0
        self.phase = "forward"
        self.log: list[tuple[str, int]] = []

    def issue(self, kind: str, unit: int, at: float) -> float:
        d = self.seconds(kind, unit, self.phase)
        if d <= 0:
            return at
        self.comm = max(self.comm, at) + d
        return self.comm

    def forward(self) -> None:
        s, units = self.schedule, self.units
        self.phase = "forward"
        s.begin_forward()
        for u in units:  # the root's pre-hook runs first, its post-hook last
            s.pre_forward(u)
            if not u.is_root:
                self.comp += self.fwd[u.i]
                s.post_forward(u)
        self.comp += self.fwd[0]  # the root's own work: embedding, head and loss
        s.post_forward(units[0])
        s.end_forward(backward_follows=True)

    def backward(self) -> None:
        s, units = self.schedule, self.units
        self.phase = "backward"
        root = units[0]
        s.pre_backward(root)
        self.comp += self.bwd[0] / 2  # loss and head
        root.unreduced = True
        for u in reversed(units[1:]):
            s.pre_backward(u)
            self.comp += self.bwd[u.i]
            u.unreduced = True
            s.post_backward(u)
        self.comp += self.bwd[0] / 2  # the embedding's gradient comes last
        s.end_backward()

    def step_seconds(self) -> float:
        """Seconds of the second step's forward and backward (the first records the order)."""
        self.forward()
        self.backward()
        self.comp = self.comm = 0.0
        self.log.clear()
        self.forward()
        self.backward()
        return self.comp
