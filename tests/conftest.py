"""Suite-wide pytest hooks.

[Note: parallel files] `make test` runs test files side by side (pytest-xdist, `--dist
loadgroup`). A file's tests stay on one worker, in order: they share module fixtures and, in
the multi-process files, one process group run for a grid of cases. The ported FSDP2 grid
(tests/dist/fsdp2/) runs every selected case of a world size in one run of processes, shared
by all of its files: it is grouped by world size (its 2- and 3-rank runs are the suite's
longest; whole, the grid would keep one worker busy while the other ran out of files), and
the cases of one world size stay together on one worker.

The groups are given to xdist's scheduler directly (`pytest_xdist_make_scheduler`), not as
`xdist_group` marks: xdist 3.8 writes a mark's group into `item._nodeid`, which pytest 9 no
longer reads, so under pytest 9 the marks were silently ignored and every test was scheduled
on its own (a file's shared runs and module fixtures then ran once on each worker). Groups go
out in collection order (multi-process files first, unit tests last), not xdist's default of
most tests first, which has nothing to do with how long a group takes.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest

# A suite started in the background of a non-interactive shell (`make test &`, a CI script's
# `&`) has SIGINT ignored, and every process the tests start would inherit that: the tests
# of Ctrl-C (tests/e2e/test_stop_*.py, test_interrupt.py) would then send a signal no rank
# receives, and wait out their bounds (seen: 5 such failures in one background run). The
# tests and their processes take SIGINT as a terminal's foreground job does; a handler set
# in Python becomes the default disposition across exec, where SIG_IGN would be kept.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# run_distributed's ranks fork from a server that imported torch and shardwise's API once
# (shardwise/testing.py); the worker modules of the multi-process tests import pytest too
# (pytest.raises in the ranks): about 1 s of CPU per rank on a loaded machine, paid once here.
os.environ.setdefault("SHARDWISE_TEST_PRELOAD", "pytest")


def group_of(nodeid: str) -> str:
    """The worker group of a test: its file, or for the FSDP2 grid its world size."""
    nodeid = nodeid.split("@")[0]  # an xdist_group suffix, should xdist add one
    path = nodeid.split("::")[0]
    if not path.startswith("tests/dist/fsdp2/"):
        return path
    world = re.search(r"-w(\d+)\]$", nodeid)
    if world is None:
        return "tests/dist/fsdp2"
    # 1 and 4 ranks: fewer cases, one group.
    return "tests/dist/fsdp2-w" + (world[1] if world[1] in ("2", "3") else "1-w4")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False
    return FileGroupScheduling(config, log)
