"""The one event schema: what the engine did, when, and how many bytes it moved.

The engine emits an `Event` only when a sink is attached to the model (`attach_sink`); with no
sink, the hot path pays one empty-list check. Everything that observes a run (metrics, traces,
the explorer) reads these events, so this file is the schema's single definition.

[Note: communication bytes] "Bytes communicated" means one thing everywhere (train's
summary, metrics.jsonl, traces, the explorer, the planner): the bytes one rank sends per
collective, which in a ring it also receives. Over a group of g ranks an all-gather or a
reduce-scatter of a B-byte buffer sends (g-1)/g * B per rank, an all-reduce twice that
(`wire_bytes`). An event's `bytes` is the buffer B as the engine allocates it; `group` is
g, filled in by the engine from the unit's mesh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

# phase: what the unit was doing; collective: which collective moved bytes ("" for compute).
PHASES = (
    "forward", "backward", "reshard", "optimizer", "step",
    "all_gather", "reduce_scatter", "all_reduce",
)
COLLECTIVES = ("", "all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Event:
    """One interval on one rank.

    rank: global rank that recorded it.
    unit: the unit's name (module FQN, "" for the root), or "" for whole-step events.
    phase: one of PHASES.
    collective: one of COLLECTIVES ("" for compute intervals).
    bytes: size of the collective's full buffer on this rank: the all-gather output, the
        reduce-scatter input, the all-reduce tensor (0 for compute).
    start, end: `time.perf_counter()` seconds on this rank.
    step: the training step the event belongs to (-1 when unknown).
    wait: seconds this rank's calling (training) thread was blocked on the collective: in
        its `wait()`, or for the whole call when the collective ran synchronously. The rest
        of [start, end] ran behind other work; `wait` is the communication it exposed
        (0 for compute intervals).
    group: ranks in the collective's group (0: not known, as in files written before it
        was recorded); see [Note: communication bytes].
    """

    rank: int
    unit: str
    phase: str
    collective: str
    bytes: int
    start: float
    end: float
    step: int = -1
    wait: float = 0.0
    group: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sent (and received) in this collective; 0 for compute."""
        return wire_bytes(self.collective, self.bytes, self.group)


def wire_bytes(collective: str, buffer_bytes: int, group: int) -> int:
    """Bytes one rank sends, and in a ring receives, in one collective of a `buffer_bytes`
    buffer over `group` ranks; see [Note: communication bytes]."""
    if not collective or group <= 1:
        return 0
    factor = 2 if collective == "all_reduce" else 1
    return factor * (group - 1) * buffer_bytes // group


EventSink = Callable[[Event], None]


def now() -> float:
    return time.perf_counter()


class Span:
    """A timed interval: `with Span() as s: ...`, then `s.start` and `s.seconds`."""

    __slots__ = ("start", "end")

    def __enter__(self) -> Span:
        self.start = now()
        self.end = self.start
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = now()

    @property
    def seconds(self) -> float:
        return self.end - self.start
