"""A rank that ends while its peer has still to read what it sent waits for that read
([Note: one-copy release] in engine/comm/one_copy.py): the peer gets the right values, and
both exit 0, at once: a freeze check still in flight does not hold the exit drain."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.engine.comm import cma

SCRIPT = Path(__file__).resolve().parent / "one_copy_exit_script.py"


@pytest.mark.skipif(not cma.enabled(), reason="no process_vm_readv here")
def test_a_rank_that_exits_first_waits_for_its_peers_read(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(SCRIPT), str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert (tmp_path / "rank1.txt").read_text() == "equal", out[-3000:]
    for r in range(2):
        assert (tmp_path / f"drained{r}.txt").read_text() == "True"
