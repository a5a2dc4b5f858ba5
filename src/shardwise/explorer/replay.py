"""`shardwise explore --replay runs/NAME`: a recorded `shardwise train` run, read back.

Inputs (written by the trainer, see train/rundir.py): `events-rank{r}.jsonl` (one engine
`Event` per line, the schema of engine/core/events.py) and `metrics.jsonl` (one record per
optimizer step; `memory_mb` holds one value per rank). Both are read tolerantly: a
truncated last line (a run killed mid-write) is skipped, not fatal.

What the page gets: a summary (ranks, recorded steps, per-step span/communication time
and bytes per rank, metrics), and on request a window of steps with every event on a
shared time axis plus the unsharded working set over time, reconstructed from the events:
an all-gather of a unit makes its full parameters live (its output bytes), the unit's
reshard frees them.

A run resumed at another world size has steps with different ranks: each step lists only
the ranks that recorded it (a resume drops the events of the steps it runs again,
train/rundir.py). Bytes are what each rank sent ([Note: communication bytes]); events
recorded before `group` was written count the step's ranks as the group.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.core.events import Event, wire_bytes
from ..observe.overlap import union_length

log = logging.getLogger(__name__)

MAX_WINDOW = 16  # steps per window request: keeps one response small
_RANK_FILE = re.compile(r"^events-rank(\d+)\.jsonl$")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d is not JSON (a truncated write?); skipped", path, i)
    return rows


def _event(row: dict) -> Event | None:
    try:
        return Event(int(row["rank"]), str(row["unit"]), str(row["phase"]),
                     str(row.get("collective", "")), int(row.get("bytes", 0)),
                     float(row["start"]), float(row["end"]), int(row.get("step", -1)),
                     float(row.get("wait", 0.0)), int(row.get("group", 0)))
    except (KeyError, TypeError, ValueError):
        return None


def _sent(e: Event, ranks: int) -> int:
    return wire_bytes(e.collective, e.bytes, e.group or ranks)


@dataclass
class Replay:
    path: Path
    events: dict[int, list[Event]]  # rank -> events sorted by start
    metrics: list[dict] = field(default_factory=list)
    config_text: str = ""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    @property
    def steps(self) -> list[int]:
        return sorted({e.step for evs in self.events.values() for e in evs})

    def _by_step(self, steps: set[int]) -> dict[int, dict[int, list[Event]]]:
        """step -> rank -> events, for the ranks that recorded that step."""
        out: dict[int, dict[int, list[Event]]] = {s: {} for s in steps}
        for r, evs in self.events.items():
            for e in evs:
                if e.step in out:
                    out[e.step].setdefault(r, []).append(e)
        return out

    def summary(self) -> dict[str, Any]:
        per_step = []
        for s, ranks in sorted(self._by_step(set(self.steps)).items()):
            row: dict[str, Any] = {"step": s, "ranks": []}
            for r, evs in sorted(ranks.items()):
                row["ranks"].append({
                    "rank": r,
                    # Wall time of the step's recorded events (collectives overlap compute).
                    "span_ms": 1e3 * (max(e.end for e in evs) - min(e.start for e in evs)),
                    # Time with a collective in flight: overlapping ones count once.
                    "comm_ms": 1e3 * union_length((e.start, e.end) for e in evs
                                                  if e.collective),
                    "bytes": sum(_sent(e, len(ranks)) for e in evs if e.collective),
                    "working_peak": max((b for _, b in working_set(evs)), default=0),
                })
            per_step.append(row)
        return {"mode": "replay", "name": self.path.name, "path": str(self.path),
                "ranks": self.ranks, "steps": self.steps, "per_step": per_step,
                "metrics": self.metrics, "config_text": self.config_text,
                "max_window": MAX_WINDOW}

    def window(self, start: int, count: int) -> dict[str, Any]:
        """Events of steps [start, start+count) on one time axis (ms from the first)."""
        count = max(1, min(int(count), MAX_WINDOW))
        wanted = {s for s in self.steps if start <= s < start + count}
        by_step = self._by_step(wanted)
        chosen = {r: [e for e in evs if e.step in wanted] for r, evs in self.events.items()}
        t0 = min((e.start for evs in chosen.values() for e in evs), default=0.0)
        ranks = []
        for r in self.ranks:
            evs = chosen[r]
            if not evs and wanted:
                continue  # this rank did not exist in these steps
            ranks.append({
                "rank": r,
                "events": [{"unit": e.unit, "phase": e.phase, "collective": e.collective,
                            "bytes": _sent(e, len(by_step[e.step])),
                            "buffer_bytes": e.bytes, "step": e.step,
                            "t0": round((e.start - t0) * 1e3, 3),
                            "t1": round((e.end - t0) * 1e3, 3)} for e in evs],
                "memory": [[round((t - t0) * 1e3, 3), b] for t, b in working_set(evs)],
            })
        return {"start": start, "count": count, "steps": sorted(wanted), "ranks": ranks}


def working_set(events: list[Event]) -> list[tuple[float, int]]:
    """(time, bytes) of unsharded parameters alive after each gather/reshard of one rank."""
    live: dict[str, int] = {}
    out: list[tuple[float, int]] = []
    for e in sorted(events, key=lambda e: e.end):
        if e.collective == "all_gather":
            live[e.unit] = e.bytes
        elif e.phase == "reshard":
            live[e.unit] = 0
        else:
            continue
        out.append((e.end, sum(live.values())))
    return out


def load_run(path: str | Path) -> Replay:
    """Read a run folder; ValueError naming what is missing if it holds no events."""
    run = Path(path).expanduser()
    if not run.is_dir():
        raise ValueError(f"--replay {str(path)!r}: no such run folder")
    files = sorted((int(m.group(1)), p) for p in run.iterdir()
                   if (m := _RANK_FILE.match(p.name)))
    if not files:
        raise ValueError(
            f"--replay {str(path)!r}: no events-rank*.jsonl in the folder (was the run "
            "recorded with --log.event_steps 0?)")
    events: dict[int, list[Event]] = {}
    for rank, p in files:
        evs = [ev for row in _read_jsonl(p) if (ev := _event(row)) is not None]
        events[rank] = sorted(evs, key=lambda e: (e.start, e.end))
    metrics_path = run / "metrics.jsonl"
    metrics = _read_jsonl(metrics_path) if metrics_path.exists() else []
    config_path = run / "config.toml"
    config_text = config_path.read_text() if config_path.exists() else ""
    return Replay(run, events, metrics, config_text)
