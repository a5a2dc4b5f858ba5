"""What the planner's two replays share: a unit for the engine's `Schedule`, and the step.

The memory replay (simulate.py) counts bytes, the time replay (timed_replay.py) keeps clocks;
both drive the engine's own `Schedule` (engine/core/schedule.py) over `ReplayUnit`s, which have
engine/core/unit.py's state machine without tensors, and both walk a step as the engine's hooks
report it (`replay_forward`, `replay_backward`). What a gather, its arrival, a reshard and a
reduction cost is each replay's own (`ReplayUnit`'s underscored methods, `StepWork`). The
schedule's decision log ([Note: decision log] in engine/core/schedule.py) records them all alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from ..engine.core.schedule import (
    Coalesce,
    PendingReduce,
    ReduceBatch,
    Schedule,
    ShardedState,
    TrainingState,
)


class ReplayUnit:
    """A unit as the schedule sees it (`ScheduledUnit`); index `i` in forward order, 0 the
    root."""

    def __init__(self, i: int, reshard_after_forward: bool) -> None:
        self.i = i
        self.state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.is_root = i == 0
        self.reshard_after_forward = reshard_after_forward
        # shard_model's rule (FSDP2's reshard_after_forward=None): the root keeps its own.
        self.reshards_after_forward = reshard_after_forward and not self.is_root
        self.reshard_after_backward = True
        self.prefetchable = True  # (a one-rank gather costs the replay nothing either way)
        self.unreduced = False  # full gradients exist that were not reduced yet
        # [Note: coalesced units] in engine/core/schedule.py: this unit's terms (None: alone).
        self.terms: Coalesce | None = None

    def unshard(self, async_op: bool = True, together: Sequence[Any] = ()) -> None:
        if self.state is not ShardedState.SHARDED:
            return
        if together:
            self._issue_group_gather(together)
            for m in together:
                m.state = ShardedState.GATHERING
            return
        self._issue_gather()
        self.state = ShardedState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is ShardedState.UNSHARDED:
            return
        self.unshard()
        self._gathered()
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        if self.state is ShardedState.SHARDED:
            return
        self.wait_unshard()
        self._freed()
        self.state = ShardedState.SHARDED

    def has_unreduced_grads(self) -> bool:
        return self.unreduced

    def reduce_grads(self, batch: Any = None) -> Sequence[PendingReduce]:
        self.unreduced = False
        if batch is not None:
            batch.pack(self)
            return ()
        return self._issue_reduce()

    def coalesce(self) -> Coalesce | None:
        return self.terms

    def open_batch(self, members: Sequence[Any]) -> ReduceBatch:
        raise NotImplementedError

    # What each replay counts.

    def _issue_gather(self) -> None:
        raise NotImplementedError

    def _issue_group_gather(self, members: Sequence[Any]) -> None:
        raise NotImplementedError

    def _gathered(self) -> None:
        raise NotImplementedError

    def _freed(self) -> None:
        raise NotImplementedError

    def _issue_reduce(self) -> Sequence[PendingReduce]:
        raise NotImplementedError


class StepWork(Protocol):
    """What happens between the schedule's calls: each replay's compute (acts or seconds)."""

    def forward(self, unit: ReplayUnit) -> None: ...
    def head_forward(self) -> None: ...
    def head_backward(self) -> None: ...
    def backward(self, unit: ReplayUnit) -> None: ...
    def root_backward(self) -> None: ...


R = TypeVar("R", bound=ReplayUnit)


def replay_forward(schedule: Schedule[R], work: StepWork) -> None:
    """Forward as the hooks report it: the root's pre-hook first, each block's pre- and
    post-hook around its compute, the root's own work (head and loss) and post-hook last."""
    units = schedule.units
    schedule.begin_forward()
    for u in units:
        schedule.pre_forward(u)
        work.forward(u)
        if not u.is_root:
            schedule.post_forward(u)
    work.head_forward()
    schedule.post_forward(units[0])
    schedule.end_forward(backward_follows=True)


def replay_backward(schedule: Schedule[R], work: StepWork) -> None:
    """Backward: the loss and head first, then each block in reverse (pre-backward, compute,
    post-backward), then what the root computes last (embedding; its inputs need no
    gradient, so its reduction comes from the final callback)."""
    units = schedule.units
    root = units[0]
    schedule.pre_backward(root)
    work.head_backward()
    root.unreduced = True
    for u in reversed(units[1:]):
        schedule.pre_backward(u)
        work.backward(u)
        u.unreduced = True
        schedule.post_backward(u)
    work.root_backward()
    schedule.end_backward()
