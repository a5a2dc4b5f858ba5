"""The overlap arithmetic and the trace's track layout, on hand-made events (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.engine.core.events import Event
from shardwise.observe.overlap import OverlapReport, overlap_rows, union_length
from shardwise.observe.trace import COMM_TID, COMPUTE_TID, Trace, _lanes, chrome_events


def test_union_length_counts_overlaps_once() -> None:
    assert union_length([]) == 0.0
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert union_length([(0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)


def test_lanes_keep_nesting_and_split_partial_overlaps() -> None:
    # (0,10) contains (1,2): one lane. (1.5, 4) overlaps (1,2) without nesting: second lane.
    assert _lanes([(0.0, 10.0), (1.0, 2.0), (3.0, 4.0)]) == [0, 0, 0]
    assert _lanes([(1.0, 2.0), (1.5, 4.0), (5.0, 6.0)]) == [0, 1, 0]


def _ev(unit: str, phase: str, coll: str, start: float, end: float, step: int,
        wait: float = 0.0, nbytes: int = 0) -> Event:
    return Event(0, unit, phase, coll, nbytes, start, end, step, wait, group=2 if coll else 0)


def test_overlap_rows_measure_union_and_waits() -> None:
    evs = [
        _ev("a", "all_gather", "all_gather", 0.0, 2.0, 1, wait=0.5, nbytes=100),
        _ev("a", "forward", "", 1.0, 4.0, 1),
        _ev("b", "all_gather", "all_gather", 1.5, 3.0, 1, wait=0.25, nbytes=100),
        _ev("a", "forward", "", 10.0, 11.0, 2),
    ]
    rows = overlap_rows(evs, 0, marks={1: -1.0, 2: 9.0}, stop=12.0)
    r1, r2 = rows
    assert (r1.step, r1.wall_s, r1.compute_s, r1.comm_s, r1.exposed_s, r1.bytes) == (
        1, 10.0, 3.0, 3.0, 0.75, 100)  # sent per rank: half of each 100-byte buffer
    assert r1.hidden == pytest.approx(0.75)
    assert (r2.wall_s, r2.comm_s, r2.hidden) == (3.0, 0.0, 0.0)
    rep = OverlapReport(rows)
    assert OverlapReport.from_dict(rep.to_dict()) == rep
    assert "exposed ms" in rep.table() and "75.0%" in rep.table()

    chrome = chrome_events(evs, rows, 0, t0=-1.0)
    x = [e for e in chrome if e["ph"] == "X" and e["cat"] != "step"]
    assert {e["tid"] for e in x if e["cat"] == "compute"} == {COMPUTE_TID}
    # The two gathers overlap without nesting: two all-gather lanes, both named.
    assert {e["tid"] for e in x if e["cat"] == "comm"} == {COMM_TID["all_gather"],
                                                           COMM_TID["all_gather"] + 1}
    assert x[0]["ts"] == 2e6 and x[0]["dur"] == 3e6  # microseconds from t0


def test_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="not empty"):
        Trace(tmp_path, model=None).start()  # type: ignore[arg-type]
    assert (tmp_path / "keep.txt").read_text() == "user data"
