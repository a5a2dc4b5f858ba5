"""Replay of a run resumed at another world size (issue 16, item 9): each step shows the
ranks it had, communication time never exceeds the step's span, and bytes are what each
rank sent ([Note: communication bytes])."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.explorer.replay import load_run
from shardwise.train import rundir
from tests.e2e.replay_fixture import UNITS, step_events


def _write(run: Path, ranks_by_step: dict[int, list[int]]) -> None:
    run.mkdir(parents=True)
    lines: dict[int, list[str]] = {}
    for step, ranks in sorted(ranks_by_step.items()):
        for r in ranks:
            lines.setdefault(r, []).extend(
                json.dumps(e.to_dict()) for e in step_events(r, step, 100.0 + 0.025 * step))
    for r, rows in lines.items():
        (run / f"events-rank{r}.jsonl").write_text("\n".join(rows) + "\n")


def test_steps_show_only_the_ranks_that_existed(tmp_path: Path) -> None:
    run = tmp_path / "resumed"
    _write(run, {1: [0, 1], 2: [0, 1], 3: [0], 4: [0]})
    replay = load_run(run)
    summary = replay.summary()
    by_step = {s["step"]: s["ranks"] for s in summary["per_step"]}
    assert [r["rank"] for r in by_step[2]] == [0, 1] and [r["rank"] for r in by_step[3]] == [0]
    for s in summary["per_step"]:
        for r in s["ranks"]:
            assert 0 < r["comm_ms"] <= r["span_ms"]
    # Events recorded without `group`: the step's ranks are the group. Two ranks: each
    # sends half of every gathered or reduced buffer; one rank sends nothing.
    per_step = 2 * sum(UNITS.values()) + sum(UNITS.values())  # 2 gathers + 1 reduce per unit
    assert by_step[2][0]["bytes"] == per_step // 2 and by_step[3][0]["bytes"] == 0
    window = replay.window(3, 2)
    assert [r["rank"] for r in window["ranks"]] == [0]


def test_resume_drops_the_events_of_steps_run_again(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _write(run, {s: [0, 1] for s in range(1, 7)})
    rundir.truncate_metrics(run / "events-rank1.jsonl", 4)
    steps = {json.loads(line)["step"] for line in
             (run / "events-rank1.jsonl").read_text().splitlines()}
    assert steps == {1, 2, 3, 4}
