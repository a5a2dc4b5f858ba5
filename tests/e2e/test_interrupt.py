"""Ctrl-C and SIGTERM on `shardwise train` and `shardwise explore` (issue 16): one line, exit
130 (SIGINT) or 143 (SIGTERM), no traceback from any process, no leaked semaphores, and no
process left behind.

A terminal's Ctrl-C reaches the whole process group, so SIGINT goes to the group here;
`kill PID` reaches the launcher alone, so SIGTERM goes to it alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
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


# SIGTERM to the launcher alone (`kill`, a container's PID 1), and to every process of the
# job (Slurm's scancel and time limit, systemd): [Note: relayed stops] in shardwise/launch.py.
@pytest.mark.parametrize("sig, group, code", [(signal.SIGINT, True, 130),
                                              (signal.SIGTERM, False, 143),
                                              (signal.SIGTERM, True, 143)])
def test_train_stops_with_one_line(sig: int, group: bool, code: int, tmp_path: Path,
                                   start: Callable[..., subprocess.Popen[str]]) -> None:
    proc = start("train", "--name", "long", "--nproc", "2", *LONG, cwd=tmp_path)
    wait_for(proc, "step    20/400")  # past the first checkpoints
    sent = time.monotonic()
    rc, err = stop(proc, sig, group)
    took = time.monotonic() - sent
    assert rc == code, err
    assert_clean(err)
    assert err.startswith("shardwise train: interrupted after step ")
    assert "; latest checkpoint step-00000" in err
    assert err.strip().endswith("continue with `shardwise train --name long --resume`")
    assert alive_in_group(proc.pid) == []
    if sig == signal.SIGTERM:
        # The step in progress is finished and checkpointed: a worker that also had the
        # signal directly took the launcher's relay as the same request (it took a second
        # SIGTERM as "stop now": the checkpoint of the stop was lost, 5 steps here). And the
        # workers end once it is written: they waited for the launcher to read their result
        # until it killed them, 25 s later.
        stopped = int(err.split("after step ")[1].split()[0])
        assert f"latest checkpoint step-{stopped:07d};" in err, err
        assert took < 15, (took, err)


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


def wait_until_ready(url: str, timeout_s: float = 180) -> None:
    """Poll the explorer's state until its sharded run is set up (the ranks answered)."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{url}/api/state", timeout=5) as r:
                status = json.load(r)["status"]
            if status == "ready":
                return
        time.sleep(0.2)
    raise AssertionError(f"the explorer's run never became ready (last status {status!r})")


@pytest.mark.parametrize("sig, group, code, ready", [
    (signal.SIGINT, True, 130, False),  # the ranks are still importing torch
    (signal.SIGINT, True, 130, True),  # the run is set up
    (signal.SIGTERM, False, 143, True),
])
def test_explore_stops_with_one_line(sig: int, group: bool, code: int, ready: bool,
                                     tmp_path: Path,
                                     start: Callable[..., subprocess.Popen[str]]) -> None:
    proc = start("explore", "--no-browser", "--world-size", "2", cwd=tmp_path)
    seen = wait_for(proc, "http://127.0.0.1:")
    if ready:
        url = re.search(r"http://127\.0\.0\.1:\d+", seen)
        assert url is not None, seen
        wait_until_ready(url.group(0))
    else:
        time.sleep(1.0)
    rc, err = stop(proc, sig, group)
    assert rc == code, err
    assert_clean(err)
    assert err.startswith(f"shardwise explore: stopped ({signal.Signals(sig).name})")
    assert alive_in_group(proc.pid) == []
