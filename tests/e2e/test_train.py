"""`shardwise train` end to end: the CLI, the run folder, resume, and a 2-node torchrun job.

Each test drives the real command in fresh processes (gloo on loopback). One uninterrupted
6-step run is shared by the module; the others copy its folder, so the whole file costs a
handful of process launches.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.engine.core.events import COLLECTIVES, PHASES, Event
from shardwise.train import options as O
from shardwise.train.metrics import MetricsFile, read_metrics

STEPS = 6
TINY = [
    "--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "4",
    "--train.steps", str(STEPS), "--train.eval_interval", "3", "--train.eval_batches", "2",
    "--checkpoint.interval", "2", "--checkpoint.keep", "2", "--log.sample_tokens", "16",
]
TIMEOUT_S = 240


def shardwise_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "train", *args], cwd=cwd, text=True,
        capture_output=True, timeout=TIMEOUT_S, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted tiny run on 2 ranks: (its run folder, its console output)."""
    cwd = tmp_path_factory.mktemp("train")
    out = ok(shardwise_train("--name", "base", "--nproc", "2", *TINY, cwd=cwd))
    return cwd / "runs" / "base", out


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def test_console_reports_progress_and_summary(run: tuple[Path, str]) -> None:
    _, out = run
    for needle in ("on 2 ranks", "val loss", "final train loss", "tokens/s", "peak memory",
                   "unsharded", "per step per rank", "all-gather", "sample:"):
        assert needle in out, needle


def test_run_folder_contents(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    names = {p.name for p in run_dir.iterdir()}
    assert names == {"config.toml", "metrics.jsonl", "events-rank0.jsonl", "events-rank1.jsonl",
                     "checkpoints", "sample.txt"}
    # Keep the last 2 of the checkpoints at steps 2, 4 and 6, and the best by validation
    # loss (checkpoint.best, on by default: docs/training.md).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best", "step-0000004", "step-0000006"]
    assert (run_dir / "sample.txt").read_text().startswith("def ")
    cfg = O.build(O.read_toml(run_dir / "config.toml"))
    assert cfg.name == "base" and cfg.model.preset == "tiny" and cfg.train.steps == STEPS
    assert cfg.resume is False


def test_metrics_schema(run: tuple[Path, str]) -> None:
    rows = read_metrics(run[0] / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert set(MetricsFile.REQUIRED) <= set(r)
        assert isinstance(r["loss"], float) and 0 < r["loss"] < 10
        assert r["lr"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
        assert len(r["memory_mb"]) == 2 and all(m > 0 for m in r["memory_mb"])
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_engine_event_logs(run: tuple[Path, str]) -> None:
    fields = set(Event.__dataclass_fields__)
    for rank in (0, 1):
        lines = (run[0] / f"events-rank{rank}.jsonl").read_text().splitlines()
        events = [Event(**json.loads(line)) for line in lines]
        assert events and all(set(json.loads(line)) == fields for line in lines[:5])
        assert all(e.rank == rank and e.phase in PHASES and e.collective in COLLECTIVES
                   for e in events)
        assert {"all_gather", "reduce_scatter"} <= {e.collective for e in events}
        assert all(e.end >= e.start for e in events)
        assert {e.step for e in events} <= set(range(1, STEPS + 1))


def _copy_without_last_checkpoint(run_dir: Path, name: str) -> Path:
    dst = run_dir.parent / name
    shutil.copytree(run_dir, dst)
    shutil.rmtree(dst / "checkpoints" / "step-0000006")
    return dst


def test_resume_matches_uninterrupted_run(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    dst = _copy_without_last_checkpoint(run_dir, "resumed")
    out = ok(shardwise_train("--name", "resumed", "--resume", cwd=run_dir.parent.parent))
    assert "resumed at step 4" in out
    # Steps 1-4 kept from before, 5-6 run again: the same losses, bit for bit.
    assert losses(dst) == losses(run_dir)
    base_val = [r.get("val_loss") for r in read_metrics(run_dir / "metrics.jsonl")]
    assert [r.get("val_loss") for r in read_metrics(dst / "metrics.jsonl")] == base_val


def test_resume_at_another_world_size(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    dst = _copy_without_last_checkpoint(run_dir, "resumed1")
    out = ok(shardwise_train("--name", "resumed1", "--resume", "--nproc", "1",
                             cwd=run_dir.parent.parent))
    assert "on 1 ranks" in out and "resumed at step 4" in out
    # Said once: the global batch halved with the data-parallel size.
    assert out.count("tokens per step change from 512 to 256") == 1, out
    got, ref = losses(dst), losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    # Other batches (1 rank reads a smaller global batch), the same trained weights.
    assert all(abs(got[s] - ref[s]) < 0.3 for s in (5, 6))
    assert len(read_metrics(dst / "metrics.jsonl")[-1]["memory_mb"]) == 1
    # The replay shows each step with the ranks it had: the resume dropped the events of
    # the steps it ran again (the first run recorded step 5 on both ranks).
    from shardwise.explorer.replay import load_run

    summary = load_run(dst).summary()
    by_step = {s["step"]: [r["rank"] for r in s["ranks"]] for s in summary["per_step"]}
    assert by_step[4] == [0, 1] and by_step[5] == by_step[6] == [0]
    assert all(r["comm_ms"] <= r["span_ms"] for s in summary["per_step"] for r in s["ranks"])


def test_existing_run_folder_is_never_overwritten(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    before = (run_dir / "metrics.jsonl").read_text()
    proc = shardwise_train("--name", "base", *TINY, cwd=run_dir.parent.parent)
    assert proc.returncode == 2
    assert "already exists" in proc.stderr and "--resume" in proc.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_user_errors_exit_2_before_launch(tmp_path: Path) -> None:
    proc = shardwise_train("--train.stpes", "3", cwd=tmp_path)
    assert proc.returncode == 2 and "did you mean train.steps" in proc.stderr
    proc = shardwise_train("--resume", cwd=tmp_path)
    assert proc.returncode == 2 and "no run folder with a checkpoint" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from shardwise.commands import train

    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"--{key} (" in text for key in O.all_keys())


def test_two_torchrun_agents_form_a_two_node_hybrid_job(tmp_path: Path) -> None:
    """Two `torchrun` agents on one machine = 2 nodes x 2 ranks: shard inside a node
    (reduce-scatter), replicate across nodes (all-reduce)."""
    from shardwise.launch import free_port

    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"e2e-{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
        "-m", "shardwise.cli", "train", "--name", "multinode",
        "--shard.sharding_strategy", "HYBRID_SHARD", *TINY, "--log.event_steps", "2",
    ]
    agents = [subprocess.Popen(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
              for _ in range(2)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    log = "\n".join(outs)
    assert all(a.returncode == 0 for a in agents), log
    assert "on 4 ranks" in log and "HYBRID_SHARD" in log and "final train loss" in log
    run_dir = tmp_path / "runs" / "multinode"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(len(r["memory_mb"]) == 4 for r in rows)
    for rank in range(4):
        events = [json.loads(line) for line in
                  (run_dir / f"events-rank{rank}.jsonl").read_text().splitlines()]
        assert {"all_gather", "reduce_scatter", "all_reduce"} <= {e["collective"]
                                                                  for e in events}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "best", "step-0000004", "step-0000006"]


def test_corrupted_latest_checkpoint_names_the_intact_older_one(run: tuple[Path, str]) -> None:
    """Issue 25: the refusal names the older checkpoint and the command that resumes it."""
    run_dir, _ = run
    dst = run_dir.parent / "corrupt"
    shutil.copytree(run_dir, dst)
    f = dst / "checkpoints" / "step-0000006" / "rank00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(data)
    proc = shardwise_train("--name", "corrupt", "--resume", "--train.steps", "8",
                           cwd=run_dir.parent.parent)
    assert proc.returncode == 2, proc.stderr
    assert "step-0000004 is intact" in proc.stderr
    assert "--name corrupt --resume-from step-0000004" in proc.stderr


def test_step_folder_without_manifest_is_set_aside_before_training(
        run: tuple[Path, str]) -> None:
    """Issue 25: resume falls back to step 4, and step 6's leftover folder no longer stops
    the run at its save: it is moved aside before the first step, and the console says so."""
    run_dir, _ = run
    dst = run_dir.parent / "noman"
    shutil.copytree(run_dir, dst)
    (dst / "checkpoints" / "step-0000006" / "manifest.json").unlink()
    out = ok(shardwise_train("--name", "noman", "--resume", cwd=run_dir.parent.parent))
    assert "resumed at step 4" in out
    assert "step-0000006 -> step-0000006.incomplete" in out
    assert (dst / "checkpoints" / "step-0000006" / "manifest.json").is_file()
    assert losses(dst) == losses(run_dir)


def test_gpt_export_records_its_shape_and_generates(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    cwd = run_dir.parent.parent
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "export", str(run_dir),
                           "gpt-export"], cwd=cwd, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shape = json.loads((cwd / "gpt-export" / "shardwise_gpt.json").read_text())
    assert shape["n_layer"] == 2 and shape["vocab_size"] == 256
    gen = subprocess.run([sys.executable, "-m", "shardwise.cli", "generate", "gpt-export",
                          "--prompt", "def ", "--max-new-tokens", "8"], cwd=cwd, text=True,
                         capture_output=True, timeout=120)
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr
