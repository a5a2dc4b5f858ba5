"""The overlap report: how much of each step's communication the training thread waited for.

Per step and per rank, from the engine's events (see `docs/tracing.md`):

- wall: from the step's start (its `Trace.step` mark, else its first event) to the next
  step's start (the last step: the trace's stop, or its last event when unmarked);
- compute: the union of the forward/backward/reshard intervals (they contain the waits
  that happen inside them);
- comm: the union of the collective intervals, each from issue to its wait returning;
- exposed: the sum of the collectives' `wait`, the time the training thread was measured
  blocked on them. The rest of `comm` ran behind other work: hidden = 1 - exposed / comm.

Waits happen one after another on one thread, each inside its collective's interval, so
exposed <= comm <= wall holds by construction; a report that breaks it is a bug.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..engine.core.events import Event

MS = 1e3


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


@dataclass(frozen=True)
class StepOverlap:
    """One step on one rank (seconds)."""

    step: int
    rank: int
    wall_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    bytes: int

    @property
    def hidden(self) -> float:
        """Fraction of communication time that ran behind compute (0 when there was none)."""
        return 1.0 - self.exposed_s / self.comm_s if self.comm_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hidden": self.hidden}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepOverlap:
        return cls(**{k: d[k] for k in ("step", "rank", "wall_s", "compute_s", "comm_s",
                                         "exposed_s", "bytes")})


def step_windows(events: list[Event], marks: dict[int, float],
                 stop: float | None) -> dict[int, tuple[float, float]]:
    """[start, end) of every step that has events, in perf_counter seconds."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for ev in events:
        first[ev.step] = min(first.get(ev.step, ev.start), ev.start)
        last[ev.step] = max(last.get(ev.step, ev.end), ev.end)
    steps = sorted(first)
    out: dict[int, tuple[float, float]] = {}
    for i, s in enumerate(steps):
        start = min(marks.get(s, first[s]), first[s])
        if i + 1 < len(steps):
            nxt = steps[i + 1]
            end = min(marks.get(nxt, first[nxt]), first[nxt])
        else:
            end = stop if (stop is not None and s in marks) else last[s]
        out[s] = (start, max(end, last[s]))
    return out


def overlap_rows(events: list[Event], rank: int, marks: dict[int, float] | None = None,
                 stop: float | None = None) -> list[StepOverlap]:
    """The report rows of one rank's events (see the module docstring for definitions)."""
    by_step: dict[int, list[Event]] = {}
    for ev in events:
        by_step.setdefault(ev.step, []).append(ev)
    rows = []
    for step, (start, end) in sorted(step_windows(events, marks or {}, stop).items()):
        evs = by_step[step]
        comm = [e for e in evs if e.collective]
        rows.append(StepOverlap(
            step=step, rank=rank, wall_s=end - start,
            compute_s=union_length((e.start, e.end) for e in evs if not e.collective),
            comm_s=union_length((e.start, e.end) for e in comm),
            exposed_s=sum(e.wait for e in comm),
            bytes=sum(e.wire_bytes for e in comm)))
    return rows


@dataclass
class OverlapReport:
    """Every rank's rows; `per_step()` averages over ranks for a console table."""

    rows: list[StepOverlap] = field(default_factory=list)

    def per_step(self) -> list[dict[str, Any]]:
        """One dict per step: means over ranks (ms), the worst rank's exposed ms, hidden."""
        steps: dict[int, list[StepOverlap]] = {}
        for r in self.rows:
            steps.setdefault(r.step, []).append(r)
        out = []
        for step, rs in sorted(steps.items()):
            n = len(rs)
            comm = sum(r.comm_s for r in rs) / n
            exposed = sum(r.exposed_s for r in rs) / n
            out.append({
                "step": step, "ranks": n,
                "wall_ms": MS * sum(r.wall_s for r in rs) / n,
                "compute_ms": MS * sum(r.compute_s for r in rs) / n,
                "comm_ms": MS * comm, "exposed_ms": MS * exposed,
                "exposed_max_ms": MS * max(r.exposed_s for r in rs),
                "hidden": 1.0 - exposed / comm if comm > 0 else 0.0,
            })
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"per_step": self.per_step(), "per_rank": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverlapReport:
        return cls([StepOverlap.from_dict(r) for r in d["per_rank"]])

    def table(self) -> str:
        """A small text table (the CLI prints it; the library only returns it)."""
        lines = [f"{'step':>6} {'wall ms':>9} {'comm ms':>9} {'exposed ms':>11} {'hidden':>7}"]
        for s in self.per_step():
            lines.append(f"{s['step']:>6} {s['wall_ms']:>9.2f} {s['comm_ms']:>9.2f} "
                         f"{s['exposed_ms']:>11.2f} {100 * s['hidden']:>6.1f}%")
        return "\n".join(lines)
