"""A newcomer's first hour, command by command (issue 16): every mistake is one `error:` line
and exit 2 whichever process found it, a crash names its rank, a 1-step run, progress
lines, export's one rule, the CLI's own consistency, and communication bytes that mean the
same in the train summary, metrics.jsonl, the event logs, the trace and the planner.

One traced 4-step run on 2 ranks is shared by the module; the rest are short or stop
before any worker starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.train.metrics import read_metrics
from tests.e2e.test_train import TIMEOUT_S, ok

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
TINY = ["--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "4",
        "--train.eval_interval", "0", "--train.eval_batches", "2", "--log.sample_tokens", "64",
        "--checkpoint.interval", "2"]


def shardwise(*args: str, cwd: Path, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", *args], cwd=cwd, text=True,
        capture_output=True, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def one_error_line(proc: subprocess.CompletedProcess[str], prog: str, needle: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    assert needle in lines[0] and "Traceback" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    cwd = tmp_path_factory.mktemp("hour")
    out = ok(shardwise("train", "--name", "t", "--nproc", "2", *TINY, "--train.steps",
                       str(STEPS), "--trace", "--log.trace_after", "1",
                       "--log.trace_steps", "2", cwd=cwd))
    return cwd / "runs" / "t", out


# --- item 1: errors -------------------------------------------------------------------------


def test_resume_of_a_finished_run_is_one_line_before_any_worker(traced: tuple[Path, str],
                                                                 tmp_path: Path) -> None:
    run, _ = traced
    proc = shardwise("train", "--name", "t", "--resume", cwd=run.parent.parent)
    one_error_line(proc, "shardwise train", "the checkpoint is at step 4; train.steps=4 "
                                            "leaves nothing to do")
    assert "launching" not in proc.stdout  # refused before any process started


def test_a_too_small_data_file_is_one_line_and_leaves_no_folder(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_bytes(b"hello world!")
    proc = shardwise("train", "--name", "b", *TINY, "--data.path", "small.txt", cwd=tmp_path)
    one_error_line(proc, "shardwise train", "the corpus has 12 bytes")
    assert not (tmp_path / "runs").exists()


def test_an_error_raised_inside_the_workers_is_one_line_too(traced: tuple[Path, str],
                                                            tmp_path: Path) -> None:
    # Only the workers can tell: the checkpoint's data position was saved with another seed.
    run, _ = traced
    dst = tmp_path / "runs" / "seed"
    shutil.copytree(run, dst)
    shutil.rmtree(dst / "checkpoints" / "step-0000004")
    proc = shardwise("train", "--name", "seed", "--resume", "--nproc", "2",
                     "--data.seed", "7", cwd=tmp_path)
    # Since the run's data key holds data.seed (issue 21), this is refused before any worker
    # starts, naming the checkpoint; the workers' own check stays behind it.
    one_error_line(proc, "shardwise train", "the data differs from what step-0000002")


def test_a_crash_names_its_rank_with_its_traceback(tmp_path: Path) -> None:
    proc = shardwise("train", "--name", "c", "--nproc", "2", *TINY, "--train.steps", "3",
                     cwd=tmp_path, env={"SHARDWISE_TEST_CRASH_AT_STEP": "2"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("shardwise train: rank 1 crashed:\nTraceback")
    assert proc.stderr.count("Traceback") == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "shardwise train: error: rank 1: RuntimeError: test crash at step 2")


def test_a_failed_start_can_be_rerun_under_the_same_name(tmp_path: Path) -> None:
    # The failure happens in the workers, after the run folder was made, before step 1.
    proc = shardwise("train", "--name", "again", "--nproc", "2", *TINY, "--train.steps", "2",
                     cwd=tmp_path, env={"SHARDWISE_TEST_CRASH_AT_STEP": "1"})
    assert proc.returncode == 1 and not (tmp_path / "runs" / "again").exists(), proc.stderr
    ok(shardwise("train", "--name", "again", "--nproc", "1", *TINY, "--train.steps", "1",
                 "--log.sample_tokens", "0", cwd=tmp_path))


# --- items 6, 7: options and progress -------------------------------------------------------


def test_progress_lines_launch_line_and_sample(traced: tuple[Path, str]) -> None:
    _, out = traced
    assert out.startswith("shardwise train: launching 2 workers")
    steps = [line for line in out.splitlines() if re.match(r"step +\d+/", line)]
    assert steps and all(re.search(r"\| lr \d\.\d\de-\d\d \| gnorm [\d.]+ \|", s)
                         and re.search(r"\d+:\d\d elapsed, ETA \d+:\d\d$", s) for s in steps)
    assert "\ufffd" not in out  # undecodable sample bytes are escaped (\x..)


def test_a_one_step_run_prints_no_nan(tmp_path: Path) -> None:
    out = ok(shardwise("train", "--name", "one", "--nproc", "1", *TINY, "--train.steps", "1",
                       "--train.lr", "1e-4", cwd=tmp_path))  # lr < the old absolute min_lr
    assert "nan" not in out.lower() and "throughput       not measured" in out


def test_resume_with_more_steps_warns_about_the_schedule(traced: tuple[Path, str],
                                                         tmp_path: Path) -> None:
    run, _ = traced
    shutil.copytree(run, tmp_path / "runs" / "more")
    proc = shardwise("train", "--name", "more", "--resume", "--train.steps", "6", "--nproc",
                     "1", "--log.sample_tokens", "0", cwd=tmp_path)
    ok(proc)
    assert ("shardwise train: warning: train.steps 4 -> 6 on resume: the cosine decay is "
            "stretched over 6 steps") in proc.stderr


# --- item 4: one definition of communication bytes ------------------------------------------


def test_bytes_agree_across_summary_metrics_events_trace_and_plan(
        traced: tuple[Path, str]) -> None:
    import torch

    import shardwise as sw
    from shardwise.engine.core.events import Event
    from shardwise.train.model import GPT, preset

    run, out = traced
    with torch.device("meta"):
        planned = sw.plan(GPT(preset("tiny")), world_size=2).comm.sent_bytes
    summary = re.search(r"communication +([\d.]+) KiB / ([\d.]+) KiB sent per step", out)
    assert summary and {float(summary[1]), float(summary[2])} == {round(planned / 1024, 2)}
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["comm_bytes"] for r in rows] == [planned] * STEPS
    for rank in (0, 1):
        events = [Event(**json.loads(line))
                  for line in (run / f"events-rank{rank}.jsonl").read_text().splitlines()]
        for step in range(1, STEPS):  # the last step's events include validation's gathers
            assert sum(e.wire_bytes for e in events if e.step == step) == planned
    overlap = json.loads((run / "trace" / "overlap.json").read_text())["per_rank"]
    assert overlap and all(r["bytes"] == planned for r in overlap)


# --- item 5: export -------------------------------------------------------------------------


def test_export_one_rule_run_folder_and_summary(traced: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = traced
    out_file = tmp_path / "model.safetensors"
    proc = shardwise("export", str(run), str(out_file), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "step-0000004 (the run's latest checkpoint)" in lines[0]
    again = shardwise("export", str(run), str(out_file), cwd=tmp_path)
    one_error_line(again, "shardwise export", "already exists; pass --force")
    assert shardwise("export", str(run), str(out_file), "--force", cwd=tmp_path).returncode == 0
    folder = tmp_path / "exported"
    assert shardwise("export", str(run / "checkpoints" / "step-0000002"), str(folder),
                     cwd=tmp_path).returncode == 0
    before = (folder / "model.safetensors").stat().st_mtime_ns
    one_error_line(shardwise("export", str(run), str(folder), cwd=tmp_path),
                   "shardwise export", "already holds an export (model.safetensors)")
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    verbose = shardwise("export", str(run), str(folder), "--force", "--verbose", cwd=tmp_path)
    assert verbose.returncode == 0 and "write  [1/" in verbose.stdout
    assert "(replaced 1 file)" in verbose.stdout.splitlines()[-1]


# --- item 8: the CLI's own consistency ------------------------------------------------------


def test_bare_command_misspelling_and_case(tmp_path: Path) -> None:
    bare = shardwise(cwd=tmp_path)
    assert bare.returncode == 2 and "commands:" in bare.stderr and "train" in bare.stderr
    one_error_line(shardwise("trian", cwd=tmp_path), "shardwise", "did you mean 'train'?")
    plan = shardwise("plan", "--model", "7B", "--world-size", "8", cwd=tmp_path)
    assert plan.returncode == 0 and "GPT '7b'" in plan.stdout


@pytest.mark.parametrize("cmd", ["train", "plan", "bench", "explore", "export", "demo"])
def test_help_names_only_files_that_exist(cmd: str, tmp_path: Path) -> None:
    proc = shardwise(cmd, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for ref in re.findall(r"[\w./-]+\.md\b", proc.stdout):
        assert (ROOT / ref).exists(), f"`shardwise {cmd} --help` names {ref}"


def test_explorer_bytes_are_the_planners() -> None:
    import shardwise as sw
    from shardwise.explorer.problem import make_model
    from shardwise.explorer.rank import wrap_policy
    from shardwise.explorer.session import _relative
    from shardwise.explorer.workers import RunConfig, WorkerGroup

    group = WorkerGroup(2)
    try:
        cfg = RunConfig(world_size=2).to_json()
        group.call("setup", config=cfg, seed=3)
        replies = group.call("step", step=1)
    finally:
        group.close()
    ranks = _relative([{"rank": r, "events": rep["events"]} for r, rep in enumerate(replies)])
    sent = {sum(e["bytes"] for e in r["events"] if e["collective"]) for r in ranks}
    planned = sw.plan(make_model(3), world_size=2, auto_wrap_policy=wrap_policy("layer"))
    assert sent == {planned.comm.sent_bytes}
