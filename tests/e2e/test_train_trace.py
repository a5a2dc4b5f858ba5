"""`shardwise train --trace`: the run folder gets a Perfetto trace and the console a report."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_train import ok, shardwise_train

ARGS = [
    "--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "4",
    "--train.steps", "4", "--train.eval_interval", "2", "--train.eval_batches", "1",
    "--checkpoint.interval", "0", "--log.sample_tokens", "0", "--log.event_steps", "0",
]


def test_train_trace_writes_files_and_prints_the_report(tmp_path: Path) -> None:
    out = ok(shardwise_train("--name", "tr", "--nproc", "2", *ARGS, "--trace",
                             "--log.trace_steps", "2", cwd=tmp_path))
    trace_dir = tmp_path / "runs" / "tr" / "trace"
    assert sorted(p.name for p in trace_dir.iterdir()) == [
        "overlap.json", "trace.json", "trace_rank0.json", "trace_rank1.json"]
    merged = json.loads((trace_dir / "trace.json").read_text())
    xs = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    # Steps 2 and 3 traced (one warm-up step); step 2's validation pass left out.
    assert sorted({e["args"]["step"] for e in xs}) == [2, 3]
    assert {e["args"]["unit"] for e in xs if e["cat"] == "compute"} >= {"", "blocks.0"}
    report = json.loads((trace_dir / "overlap.json").read_text())
    assert [s["step"] for s in report["per_step"]] == [2, 3]
    for r in report["per_rank"]:
        assert 0 < r["exposed_s"] <= r["comm_s"] <= r["wall_s"], r
    assert "exposed ms" in out and "hidden" in out
    assert "trace: runs/tr/trace/trace.json (open in https://ui.perfetto.dev)" in out
    for s in report["per_step"]:
        assert f"{s['exposed_ms']:.2f}" in out
