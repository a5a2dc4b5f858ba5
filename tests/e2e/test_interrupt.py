"""Ctrl-C and SIGTERM on `shardwise train` and `shardwise explore` (issue 16): one line, exit
130 (SIGINT) or 143 (SIGTERM), no traceback from any process, no leaked semaphores, and no
process left behind.

A terminal's Ctrl-C reaches the whole process group, so SIGINT goes to the group here;
`kill PID` reaches the launcher alone, so SIGTERM goes to it alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.test_first_hour import TINY

# Plain progress lines come every steps/20 = 20 steps; a checkpoint every 5.
LONG = [*TINY, "--train.steps", "400", "--checkpoint.interval", "5"]


@pytest.fixture
def start() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Starts `shardwise ...` in its own process group; kills the group if a test fails."""
    procs: list[subprocess.Popen[str]] = []

    def _start(*args: str, cwd: Path) -> subprocess.Popen[str]:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "shardwise.cli", *args], cwd=cwd, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        return procs[-1]

    yield _start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for(proc: subprocess.Popen[str], needle: str, timeout_s: float = 180) -> str:
    """Read stdout lines until one contains `needle`."""
    seen = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never saw {needle!r}:\n{''.join(seen)}")


def stop(proc: subprocess.Popen[str], sig: int, group: bool) -> tuple[int, str]:
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def alive_in_group(pgid: int) -> list[str]:
    """Processes of the group still running (zombies are gone already, only not reaped)."""
    time.sleep(1.0)
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,pid=,args="], capture_output=True,
                         text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [" ".join(r) for r in rows if len(r) >= 3 and r[0] == str(pgid)
            and not r[1].startswith("Z")]


def assert_clean(err: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "leaked semaphore" not in err and "SignalException" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("sig, group, code", [(signal.SIGINT, True, 130),
                                              (signal.SIGTERM, False, 143)])
def test_train_stops_with_one_line(sig: int, group: bool, code: int, tmp_path: Path,
                                   start: Callable[..., subprocess.Popen[str]]) -> None:
    proc = start("train", "--name", "long", "--nproc", "2", *LONG, cwd=tmp_path)
    wait_for(proc, "step    20/400")  # past the first checkpoints
    rc, err = stop(proc, sig, group)
    assert rc == code, err
    assert_clean(err)
    assert err.startswith("shardwise train: interrupted after step ")
    assert "; latest checkpoint step-00000" in err
    assert err.strip().endswith("continue with `shardwise train --name long --resume`")
    assert alive_in_group(proc.pid) == []


def test_ctrl_c_while_workers_start_leaves_nothing(
        tmp_path: Path, start: Callable[..., subprocess.Popen[str]]) -> None:
    proc = start("train", "--name", "early", "--nproc", "2", *LONG, cwd=tmp_path)
    wait_for(proc, "launching 2 workers")
    time.sleep(2.0)  # the workers are importing torch
    rc, err = stop(proc, signal.SIGINT, True)
    assert rc == 130, err
    assert_clean(err)
    assert err.strip() == "shardwise train: interrupted before the first step; nothing was saved"
    assert not (tmp_path / "runs" / "early").exists()
    assert alive_in_group(proc.pid) == []


@pytest.mark.parametrize("sig, group, code, delay", [
    (signal.SIGINT, True, 130, 1.0),  # the ranks are still importing torch
    (signal.SIGINT, True, 130, 20.0),  # the run is set up
    (signal.SIGTERM, False, 143, 20.0),
])
def test_explore_stops_with_one_line(sig: int, group: bool, code: int, delay: float,
                                     tmp_path: Path,
                                     start: Callable[..., subprocess.Popen[str]]) -> None:
    proc = start("explore", "--no-browser", "--world-size", "2", cwd=tmp_path)
    wait_for(proc, "http://127.0.0.1:")
    time.sleep(delay)
    rc, err = stop(proc, sig, group)
    assert rc == code, err
    assert_clean(err)
    assert err.startswith(f"shardwise explore: stopped ({signal.Signals(sig).name})")
    assert alive_in_group(proc.pid) == []
