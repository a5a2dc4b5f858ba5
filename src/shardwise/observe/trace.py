"""Chrome/Perfetto traces of a sharded model's steps, and the overlap report.

    with sw.trace("traces/run1", model) as t:
        for step in range(1, 4):
            t.step(step)                      # labels events; the report is per step
            model(x).sum().backward(); opt.step(); opt.zero_grad()
    print(t.report.table())                   # the CLI prints; the library only returns

Every rank writes `trace_rank{r}.json`; rank 0 also writes the merged `trace.json` (one
process per rank) and `overlap.json`. On a model sharded on a subgroup, its ranks take part
and its first rank writes the merged files ([Note: model ranks] in engine/core/context.py).
Files are Chrome trace-event JSON: complete events ("ph": "X") with microsecond
`ts`/`dur`, opened by https://ui.perfetto.dev.

Clocks: `perf_counter` has an arbitrary origin in every process. Each rank's times are made
relative to its own trace start, taken right after a collective that every rank leaves at
(nearly) the same moment, so ranks line up to within that collective's skew.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from ..engine.comm import collectives as C
from ..engine.core.context import model_group
from ..engine.core.events import COLLECTIVES, Event, now
from .overlap import OverlapReport, StepOverlap, overlap_rows, step_windows
from .sinks import attach_sink, detach_sink, set_step

US = 1e6
# Track (tid) bases: every kind gets a block of 10 lanes; an interval that overlaps another
# of its kind without nesting in it goes to the next lane (Perfetto misdraws such events).
STEP_TID = 1
COMPUTE_TID = 10
COMM_TID = {c: 10 * (i + 2) for i, c in enumerate(COLLECTIVES[1:])}


def _lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A lane per interval such that, within a lane, intervals nest or are disjoint."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    stacks: list[list[float]] = []  # per lane: the ends of the intervals still open
    lane_of = [0] * len(intervals)
    for i in order:
        s, e = intervals[i]
        lane = len(stacks)
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= s:
                stack.pop()  # closed before this one starts
            if not stack or stack[-1] >= e:
                lane = k
                break
        if lane == len(stacks):
            stacks.append([])
        stacks[lane].append(e)
        lane_of[i] = lane
    return lane_of


def _track_name(kind: str, lane: int) -> str:
    return kind if lane == 0 else f"{kind} ({lane + 1})"


def chrome_events(events: list[Event], rows: list[StepOverlap], rank: int, t0: float,
                  windows: dict[int, tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """One rank's trace events: metadata, a step track, compute and one track per collective."""
    names: dict[int, str] = {}
    out: list[dict[str, Any]] = []

    def complete(name: str, cat: str, tid: int, start: float, end: float,
                 args: dict[str, Any]) -> None:
        out.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
                    "ts": round((start - t0) * US, 3),
                    "dur": round(max(end - start, 0.0) * US, 3), "args": args})

    compute = [e for e in events if not e.collective]
    for ev, lane in zip(compute, _lanes([(e.start, e.end) for e in compute])):
        tid = COMPUTE_TID + lane
        names[tid] = _track_name("compute", lane)
        complete(f"{ev.phase} {ev.unit or '(root)'}", "compute", tid, ev.start, ev.end,
                 {"unit": ev.unit, "phase": ev.phase, "step": ev.step})
    for kind, base in COMM_TID.items():
        comm = [e for e in events if e.collective == kind]
        for ev, lane in zip(comm, _lanes([(e.start, e.end) for e in comm])):
            tid = base + lane
            names[tid] = _track_name(kind, lane)
            complete(f"{kind} {ev.unit or '(root)'}", "comm", tid, ev.start, ev.end,
                     {"unit": ev.unit, "collective": kind, "bytes": ev.wire_bytes,
                      "buffer_bytes": ev.bytes, "group": ev.group,
                      "step": ev.step, "wait_ms": round(ev.wait * 1e3, 6)})
    for row in rows:
        if windows and row.step in windows:
            names[STEP_TID] = "steps"
            start, end = windows[row.step]
            complete(f"step {row.step}", "step", STEP_TID, start, end, row.to_dict())
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
         "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
         "args": {"sort_index": rank}},
    ]
    for tid, name in sorted(names.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                     "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                     "args": {"sort_index": tid}})
    return meta + out


def _write_json(path: Path, obj: Any) -> None:
    # Write then rename: a crash never leaves a half-written trace under the final name.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def trace_document(events: list[dict[str, Any]]) -> dict[str, Any]:
    return {"traceEvents": events, "displayTimeUnit": "ms"}


class Trace:
    """An event sink that records one rank's engine events and writes them as a trace.

    Use `sw.trace(directory, model)`; or `start()` / `step(n)` / `stop()` by hand (the
    trainer does). `directory` must be missing or empty on every rank: a trace never
    overwrites files. Collective calls: `start()` and `stop()` must run on every rank of
    the model (on a subgroup, no other rank).
    """

    def __init__(self, directory: str | Path, model: nn.Module) -> None:
        self.dir = Path(directory).expanduser()
        self.model = model
        self.rank = C.rank() if C.is_initialized() else 0
        # The ranks the collectives of start() and stop() run over, and the merged file's
        # writer: the model's (the world unless it is sharded on a subgroup).
        self.group = model_group(model)
        self.events: list[Event] = []
        # Step start times from `step(n)`: they make each step's wall time end-to-end.
        self.marks: dict[int, float] = {}
        # Set around work whose events do not belong in the trace (evaluation).
        self.paused = False
        self.t0 = 0.0
        self.report: OverlapReport | None = None
        self._active = False

    def __call__(self, ev: Event) -> None:
        if not self.paused:
            self.events.append(ev)

    @property
    def rank_path(self) -> Path:
        return self.dir / f"trace_rank{self.rank}.json"

    @property
    def merged_path(self) -> Path:
        """The merged trace (written by the model's first rank: rank 0 on every rank)."""
        return self.dir / "trace.json"

    @property
    def overlap_path(self) -> Path:
        return self.dir / "overlap.json"

    def start(self) -> Trace:
        """Check the directory on every rank, then attach (collective)."""
        clash = self.dir.exists() and (not self.dir.is_dir() or any(self.dir.iterdir()))
        # Agreed on by all ranks, so a clash on one rank raises on all instead of a hang.
        if not self.group.agree(not clash, label="trace.start"):
            where = "" if clash else " on another rank"
            raise ValueError(f"trace directory {str(self.dir)!r}{where} is not empty (or is a "
                             "file): traces never overwrite files; pass a new or empty one")
        self.dir.mkdir(parents=True, exist_ok=True)
        attach_sink(self.model, self)
        self._active = True
        self.t0 = now()
        return self

    def step(self, n: int) -> None:
        """Mark the start of training step `n`: label the following events with it."""
        set_step(self.model, n)
        self.marks[n] = now()

    def _detach(self) -> float:
        t_stop = now()
        if self._active:
            detach_sink(self.model, self)
            self._active = False
        return t_stop

    def stop(self) -> OverlapReport:
        """Detach, write this rank's file, merge on rank 0; every rank gets the report."""
        t_stop = self._detach()
        rows = overlap_rows(self.events, self.rank, self.marks, t_stop)
        windows = step_windows(self.events, self.marks, t_stop)
        mine = chrome_events(self.events, rows, self.rank, self.t0, windows)
        _write_json(self.rank_path, trace_document(mine))
        # Raw JSON bytes through the byte collectives: no pickle crosses ranks.
        all_rows = [json.loads(b) for b in self.group.all_gather_bytes(
            json.dumps([r.to_dict() for r in rows]).encode())]
        report = OverlapReport([StepOverlap.from_dict(d) for rank in all_rows for d in rank])
        traces = self.group.gather_bytes(json.dumps(mine).encode())
        if self.group.is_first:
            merged = [ev for b in traces for ev in json.loads(b)]
            _write_json(self.merged_path, trace_document(merged))
            _write_json(self.overlap_path, report.to_dict())
        self.report = report
        return report

    def abort(self) -> None:
        """Detach and write this rank's own file only (no collectives: ranks may diverge)."""
        t_stop = self._detach()
        rows = overlap_rows(self.events, self.rank, self.marks, t_stop)
        _write_json(self.rank_path, trace_document(
            chrome_events(self.events, rows, self.rank, self.t0)))


@contextmanager
def trace(directory: str | Path, model: nn.Module) -> Iterator[Trace]:
    """Trace `model` (a sharded root) inside the block; see the module docstring.

    On leaving the block every rank writes `directory/trace_rank{r}.json`, rank 0 the
    merged `trace.json` and `overlap.json`, and `handle.report` is the `OverlapReport`
    on every rank. If the block raises, only this rank's own file is written.
    """
    t = Trace(directory, model).start()
    try:
        yield t
    except BaseException:
        t.abort()
        raise
    t.stop()
