"""A user script with no teardown exits 0 ([Note: gloo teardown]); a failing one, promptly.

The full measurement (200 launches at 2 ranks, 100 at 3) is benchmarks/exit_stress.py;
this runs the same script a handful of times and checks every exit code. A handful of
launches against an abort rate of about 1 in 9 without the fix would catch a regression only
about half the time, so it is a smoke test: the deterministic check is
tests/dist/test_handoff.py, which fails on every run where a collective bypasses the exit
drain's handoff or finish() returns while gloo still holds a tensor.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "exit_user_script.py"


def _launch(nproc: int, out: Path, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(SCRIPT), str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.parametrize("nproc,runs", [(2, 4), (3, 2)])
def test_script_without_teardown_exits_zero(tmp_path: Path, nproc: int, runs: int) -> None:
    for i in range(runs):
        rc, out, _ = _launch(nproc, tmp_path / f"ckpt-{i}")
        assert rc == 0, f"launch {i} at {nproc} ranks exited {rc}:\n{out[-3000:]}"
        assert "terminate called" not in out
        assert (tmp_path / f"ckpt-{i}" / "manifest.json").exists()


def test_failing_rank_exits_promptly_with_its_own_status(tmp_path: Path) -> None:
    rc, out, seconds = _launch(2, tmp_path / "ckpt", {"SW_EXIT_FAIL_RANK": "1"})
    assert rc != 0
    assert "rank 1 fails on purpose" in out
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    # The failing rank exits 1; torchrun may stop the other with SIGTERM (-15); never -6.
    assert "1" in codes and "-6" not in codes, f"worker exit codes {codes}:\n{out[-3000:]}"
    assert "terminate called" not in out
    assert seconds < 90, f"took {seconds:.0f}s: the exit drain waited on the failed rank"


def test_sys_exit_1_with_a_peer_in_a_collective_ends_in_seconds(tmp_path: Path) -> None:
    # Before: rank 1's exit drain took sys.exit(1) for a clean end and waited at a barrier
    # that paired with rank 0's all-gather, and both sat out the collective timeout.
    env = {"SW_EXIT_FAIL_RANK": "1", "SW_EXIT_MODE": "sys_exit", "SHARDWISE_TIMEOUT": "150"}
    rc, out, seconds = _launch(2, tmp_path / "ckpt", env)
    assert rc != 0 and "rank 1 exits 1 on purpose" in out, out[-3000:]
    assert "terminate called" not in out
    # The script itself takes ~10-25 s here (two torch imports on a busy 2-core machine);
    # waiting out the 150 s timeout would take far longer.
    assert seconds < 90, f"took {seconds:.0f}s: the exit waited on a peer's collective"

