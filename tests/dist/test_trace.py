"""`sw.trace`: per-rank and merged Chrome traces, and the overlap report, on 2 and 3 ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardwise.testing import run_distributed
from tests.dist import trace_workers as W


def _load(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    evs = doc["traceEvents"]
    for e in evs:
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0, e
    return evs


def _check_rank(evs: list[dict[str, Any]], rank: int, res: dict[str, Any]) -> None:
    xs = [e for e in evs if e["ph"] == "X" and e["pid"] == rank]
    named = {e["tid"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"
             and e["pid"] == rank}
    assert {e["tid"] for e in xs} <= named, "every track has a name"
    compute = [e for e in xs if e["cat"] == "compute"]
    comm = [e for e in xs if e["cat"] == "comm"]
    assert compute and comm
    assert not {e["tid"] for e in compute} & {e["tid"] for e in comm}
    gathers = [e for e in comm if e["args"]["collective"] == "all_gather"]
    assert {e["tid"] for e in gathers}.isdisjoint(
        {e["tid"] for e in comm if e["args"]["collective"] == "reduce_scatter"})
    units = set(res["gather_bytes"])
    assert {e["args"]["unit"] for e in compute} == units
    assert {e["args"]["unit"] for e in gathers} == units
    for step in range(1, W.STEPS + 1):
        for unit, nbytes in res["gather_bytes"].items():
            got = [e["args"]["buffer_bytes"] for e in gathers
                   if e["args"]["unit"] == unit and e["args"]["step"] == step]
            # FULL_SHARD gathers a resharded unit again for backward; the root stays gathered.
            assert got == [nbytes] * (2 if res["reshards"][unit] else 1), (unit, step, got)
    assert all(e["args"]["wait_ms"] >= 0 for e in comm)
    steps = [e for e in xs if e["cat"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(1, W.STEPS + 1))


@pytest.mark.parametrize("world", [2, 3])
def test_trace_files_and_overlap_report(world: int, tmp_path: Path) -> None:
    out = tmp_path / "trace"
    results = run_distributed(W.traced, world, str(out))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["trace.json", "overlap.json"] + [f"trace_rank{r}.json" for r in range(world)])
    merged = _load(out / "trace.json")
    assert {e["pid"] for e in merged} == set(range(world))
    for rank, res in enumerate(results):
        assert res["rank_path"] == str(out / f"trace_rank{rank}.json")
        _check_rank(_load(out / f"trace_rank{rank}.json"), rank, res)
        _check_rank(merged, rank, res)
        assert str(out) in res["refused"] and "not empty" in res["refused"]
        assert res["report"] == results[0]["report"], "every rank gets the same report"

    report = json.loads((out / "overlap.json").read_text())
    assert report == results[0]["report"]
    rows = report["per_rank"]
    assert sorted((r["step"], r["rank"]) for r in rows) == [
        (s, r) for s in range(1, W.STEPS + 1) for r in range(world)]
    for r in rows:
        assert 0 < r["exposed_s"] <= r["comm_s"] <= r["wall_s"], r
        assert 0 < r["compute_s"] <= r["wall_s"], r
        assert 0.0 <= r["hidden"] < 1.0, r
        # Report bytes are wire bytes ([Note: communication bytes]): (g-1)/g of each buffer.
        gather = sum(b * (2 if results[0]["reshards"][u] else 1)
                     for u, b in results[0]["gather_bytes"].items()) * (world - 1) // world
        assert r["bytes"] > gather  # all-gathers plus the reduce-scatters
    per_step = report["per_step"]
    assert [s["step"] for s in per_step] == list(range(1, W.STEPS + 1))
    print(f"world {world}: exposed comm per step (ms, mean over ranks):",
          [round(s["exposed_ms"], 2) for s in per_step],
          "of comm", [round(s["comm_ms"], 2) for s in per_step],
          "wall", [round(s["wall_ms"], 2) for s in per_step])


def test_hybrid_all_reduce_is_measured_as_exposed(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    run_distributed(W.traced_hybrid, 4, str(out), env={"LOCAL_WORLD_SIZE": "2"})
    for rank in range(4):
        evs = _load(out / f"trace_rank{rank}.json")
        reduces = [e for e in evs if e["ph"] == "X" and e.get("args", {}).get("collective")
                   == "all_reduce"]
        assert reduces, "HYBRID_SHARD all-reduces across replicas"
        for e in reduces:
            # A synchronous call: blocked for all of it (µs in the file, ms in wait_ms).
            assert e["args"]["wait_ms"] * 1e3 == pytest.approx(e["dur"], rel=0.05, abs=2.0)
