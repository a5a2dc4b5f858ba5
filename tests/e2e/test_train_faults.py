"""`shardwise train` under faults: non-finite steps, a NaN checkpoint, a rank SIGKILLed mid-run.

Divergence is real (lr 1e30 overflows the weights after one step); a NaN on one rank only
and the kill use the trainer's fault injector (SHARDWISE_TEST_*, shardwise/train/faults.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.train import options as O
from shardwise.train.faults import FaultInjector
from shardwise.train.guard import NonFiniteError, NonFiniteGuard
from shardwise.train.metrics import read_metrics
from tests.e2e.test_train import TIMEOUT_S, ok

BASE = [
    "--model.preset", "tiny", "--data.max_bytes", "200000", "--train.batch_size", "4",
    "--train.eval_interval", "0", "--train.eval_batches", "2", "--checkpoint.keep", "10",
    "--log.sample_tokens", "0", "--log.event_steps", "0",
]
DIVERGE = ["--train.lr", "1e30", "--train.min_lr_ratio", "0", "--train.warmup_steps", "0",
           "--train.schedule", "constant"]


def train(*args: str, cwd: Path, env: dict[str, str] | None = None,
          torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1"] if torchrun else []
    return subprocess.run(
        [sys.executable, *launcher, "-m", "shardwise.cli", "train", *args], cwd=cwd,
        text=True, capture_output=True, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def checkpoint_steps(run_dir: Path) -> list[int]:
    # (checkpoints/best/, the best by validation loss, is no step folder.)
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.startswith("step-"))


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank file of a checkpoint, keyed by file and name."""
    return {f"{f.name}:{k}": v for f in sorted(ckpt.glob("*.safetensors"))
            for k, v in load_file(f).items()}


def assert_all_finite(run_dir: Path) -> None:
    for step in checkpoint_steps(run_dir):
        for name, t in tensors(run_dir / "checkpoints" / f"step-{step:07d}").items():
            assert torch.isfinite(t).all(), f"step {step}: {name} is not finite"


# --- the guard's decisions, in-process -----------------------------------------------------


def test_guard_stop_skip_and_the_limit() -> None:
    g = NonFiniteGuard("stop", 10, scaler_handles_grads=False)
    assert g.check(1, 2.5, 0.7)
    with pytest.raises(NonFiniteError, match=r"non-finite loss nan at step 7 \(grad norm inf\); "
                                             r"stopping \(set train.on_nonfinite=skip"):
        g.check(7, math.nan, math.inf)
    with pytest.raises(NonFiniteError, match="non-finite grad norm inf at step 3"):
        g.check(3, 2.5, math.inf)
    g = NonFiniteGuard("skip", 2, scaler_handles_grads=False)
    assert [g.check(s, math.nan, 1.0) for s in (1, 2)] == [False, False]
    assert g.check(3, 1.0, 1.0) and g.skipped == 2  # a finite step resets the run of skips
    assert not g.check(4, 1.0, math.nan) and not g.check(5, math.inf, 1.0)
    with pytest.raises(NonFiniteError, match="3 steps in a row.*max_skipped_steps=2"):
        g.check(6, math.nan, math.nan)
    # fp16: an overflowing gradient is the loss scaler's to skip, a non-finite loss is not.
    g = NonFiniteGuard("skip", 10, scaler_handles_grads=True)
    assert g.check(1, 2.5, math.inf) and g.skipped == 0
    assert not g.check(2, math.inf, math.inf) and g.skipped == 1


def test_fault_injector_exists_only_when_a_test_asks_for_one() -> None:
    assert FaultInjector.from_env({}) is None  # a normal run: no fault checks per step
    faults = FaultInjector.from_env({"SHARDWISE_TEST_NAN_AT_STEPS": "3,4"})
    assert faults is not None and faults.nan_at == {3, 4} and not faults.kill_at
    one = torch.tensor(1.0)
    assert math.isnan(faults.loss(one, 3, rank=1).item())
    assert faults.loss(one, 3, rank=0).item() == 1.0  # only rank 1: the ranks must agree
    assert faults.loss(one, 5, rank=1).item() == 1.0
    crash = FaultInjector.from_env({"SHARDWISE_TEST_CRASH_AT_STEP": "2"})
    assert crash is not None
    crash.before_step(1, rank=1)
    with pytest.raises(RuntimeError, match="test crash at step 2"):
        crash.before_step(2, rank=1)


def test_on_nonfinite_is_validated() -> None:
    with pytest.raises(ValueError, match=r"train.on_nonfinite='halt' is not one of: stop, skip"):
        O.build({"train.on_nonfinite": "halt"})
    with pytest.raises(ValueError, match="train.max_skipped_steps=-1"):
        O.build({"train.max_skipped_steps": "-1"})
    assert O.build({"train.on_nonfinite": "skip"}).train.on_nonfinite == "skip"


# --- the trainer ---------------------------------------------------------------------------


def test_divergence_stops_naming_the_step_and_saves_nothing_nonfinite(tmp_path: Path) -> None:
    proc = train("--name", "div", "--nproc", "2", *BASE, *DIVERGE, "--train.steps", "6",
                 "--checkpoint.interval", "1", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert ("shardwise train: error: non-finite loss nan at step 2 (grad norm nan); stopping "
            "(set train.on_nonfinite=skip to skip such steps)") in proc.stderr
    assert "Traceback" not in proc.stderr
    run_dir = tmp_path / "runs" / "div"
    assert checkpoint_steps(run_dir) == [1]  # before the bad step; none for it or after
    assert_all_finite(run_dir)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]


def test_skip_mode_drops_the_steps_and_reports_them(tmp_path: Path) -> None:
    # Rank 1 alone sees a NaN loss at steps 3 and 4: both ranks must skip them.
    proc = train("--name", "skip", "--nproc", "2", *BASE, "--train.steps", "6",
                 "--checkpoint.interval", "2", "--train.on_nonfinite", "skip",
                 "--train.max_skipped_steps", "2", cwd=tmp_path,
                 env={"SHARDWISE_TEST_NAN_AT_STEPS": "3,4"})
    out = ok(proc)
    assert "step     3: non-finite loss or grad norm; step skipped (1 so far)" in out
    assert "skipped steps    2 (non-finite loss or grad norm)" in out
    run_dir = tmp_path / "runs" / "skip"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.get("nonfinite", False) for r in rows] == [False, False, True, True, False, False]
    assert rows[3]["nonfinite_skipped"] == 2 and math.isnan(rows[2]["loss"])
    assert all(math.isfinite(r["loss"]) for r in rows if not r.get("nonfinite"))
    assert_all_finite(run_dir)
    # Skipped steps change nothing: weights and AdamW state after step 4 are those after 2.
    at2, at4 = (tensors(run_dir / "checkpoints" / f"step-{s:07d}") for s in (2, 4))
    assert at2.keys() == at4.keys() and all(torch.equal(at2[k], at4[k]) for k in at2)


# --- the library guard ---------------------------------------------------------------------


def _save_nan(rank: int, world: int, path: str) -> dict[str, object]:
    import shardwise as sw
    from tests.models import make_model

    model = make_model("lm", 0)
    sw.shard_model(model)
    opt = torch.optim.AdamW(model.parameters())
    if rank == 1:  # a NaN in one rank's shard only
        with torch.no_grad():
            p = next(model.parameters())
            # The DTensor's local rows are the shard itself.
            (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] = math.nan
    try:
        sw.save_checkpoint(path, model, opt, step=1)
        refused = ""
    except ValueError as e:
        refused = str(e)
    leftovers = sorted(os.listdir(os.path.dirname(path)))
    sw.save_checkpoint(path, model, opt, step=1, allow_nonfinite=True)
    return {"refused": refused, "leftovers": leftovers}


def test_save_checkpoint_refuses_nan_on_every_rank_and_writes_nothing(tmp_path: Path) -> None:
    from shardwise.testing import run_distributed

    path = str(tmp_path / "ckpt" / "c")
    os.makedirs(os.path.dirname(path))
    r0, r1 = run_distributed(_save_nan, 2, path)
    assert "refusing to save a non-finite checkpoint" in r1["refused"]
    assert "1 NaN/inf value in rank 1's shard" in r1["refused"]
    assert "allow_nonfinite=True" in r1["refused"]
    assert r0["refused"] and "(raised on rank 1)" in r0["refused"]
    assert r0["leftovers"] == r1["leftovers"] == []
    # allow_nonfinite=True saves it anyway.
    assert json.loads((tmp_path / "ckpt" / "c" / "manifest.json").read_text())["step"] == 1


# --- restarts ------------------------------------------------------------------------------

RESTART = [*BASE, "--train.steps", "8", "--checkpoint.interval", "2", "--train.eval_interval",
           "4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("restart")
    ok(train("--name", "ref", "--nproc", "2", *RESTART, cwd=cwd))
    return cwd / "runs" / "ref"


def assert_same_run(run_dir: Path, ref: Path) -> None:
    final = tensors(run_dir / "checkpoints" / "step-0000008")
    want = tensors(ref / "checkpoints" / "step-0000008")
    assert final.keys() == want.keys()
    assert all(torch.equal(final[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(final[k], want[k])]
    got, exp = read_metrics(run_dir / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in got] == \
        [(r["step"], r["loss"], r.get("val_loss")) for r in exp]


def test_torchrun_restart_after_sigkill_ends_like_an_uninterrupted_run(
        tmp_path: Path, uninterrupted: Path) -> None:
    proc = train("--name", "killed", *RESTART, cwd=tmp_path, torchrun=True,
                 env={"SHARDWISE_TEST_KILL_AT_STEP": "5"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "exitcode: -9" in log and "resumed at step 4" in log  # killed, then resumed
    assert_same_run(tmp_path / "runs" / "killed", uninterrupted)


def test_nproc_max_restarts_resumes_after_sigkill(tmp_path: Path, uninterrupted: Path) -> None:
    proc = train("--name", "killed", "--nproc", "2", "--max-restarts", "1", *RESTART,
                 cwd=tmp_path, env={"SHARDWISE_TEST_KILL_AT_STEP": "5"})
    log = ok(proc) + proc.stderr
    assert "a worker failed (first seen: rank" in log and "restart 1 of 1" in log, log
    assert "resumed at step 4" in log and "restart 1 of the workers" in log
    assert "Traceback" not in log
    assert_same_run(tmp_path / "runs" / "killed", uninterrupted)
