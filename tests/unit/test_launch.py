"""`shardwise.launch`: how a launch ends (values, WorkerFailure, no temporary folders left)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from shardwise.launch import WorkerFailure, launch


def _rank() -> int:
    return int(os.environ["RANK"])


def _value_error_on_rank_1() -> int:
    if _rank() == 1:
        raise ValueError("bad value on purpose")
    return _rank()


def _crash_on_rank_0() -> int:
    if _rank() == 0:
        raise KeyError("unexpected")
    return _rank()


def test_values_and_no_temporary_folders(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # torchelastic's default leaves an empty /tmp/torchelastic_* behind per launch.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch(_rank, 2) == [0, 1]
    assert list(tmp_path.iterdir()) == []
    assert "SHARDWISE_WORKER" not in os.environ


def test_expected_errors_are_one_line_and_crashes_carry_a_traceback() -> None:
    with pytest.raises(WorkerFailure) as info:
        launch(_value_error_on_rank_1, 2, expected={ValueError: 2})
    e = info.value
    assert (e.rank, e.exit_code, e.message, e.traceback) == (1, 2, "bad value on purpose", "")
    with pytest.raises(WorkerFailure) as info:
        launch(_crash_on_rank_0, 2, expected={ValueError: 2})
    e = info.value
    assert (e.rank, e.exit_code, e.message) == (0, 1, "KeyError: 'unexpected'")
    assert e.traceback.startswith("Traceback") and "_crash_on_rank_0" in e.traceback


def test_workers_fork_only_from_a_launcher_without_new_threads() -> None:
    """[Note: forked workers]: fork on Linux without CUDA while the launcher has started no
    thread since it imported the launcher (an OpenMP pool a fork leaves behind would hang
    the child's first parallel region); spawn otherwise, or as SHARDWISE_START_METHOD says."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from shardwise.launch import launch, start_method\n"
        "first = start_method()\n"
        "pids = launch(__import__('os').getpid, 2)\n"
        "torch.set_num_threads(2)\n"
        "torch.randn(1_000_000).mul(2).sum()  # starts an OpenMP worker thread\n"
        "print(first, start_method(), len(set(pids)))\n")
    env = {k: v for k, v in os.environ.items() if k != "SHARDWISE_START_METHOD"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fork", "spawn", "2"], out.stdout + out.stderr
    forced = subprocess.run(
        [sys.executable, "-c", "from shardwise.launch import start_method; print(start_method())"],
        env={**env, "SHARDWISE_START_METHOD": "spawn"}, capture_output=True, text=True,
        timeout=300)
    assert forced.stdout.split() == ["spawn"], forced.stdout + forced.stderr
