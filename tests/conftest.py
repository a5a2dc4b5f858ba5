"""Suite-wide pytest hooks.

[Note: parallel files] `make test` runs test files side by side (pytest-xdist, `--dist
loadgroup`). A file's tests stay on one worker, in order: they share module fixtures and, in
the multi-process files, one process group run for a grid of cases. The ported FSDP2 grid
(tests/dist/fsdp2/) runs every selected case of a world size in one run of processes, shared
by all of its files: it is grouped by world size (its 2- and 3-rank runs are the suite's
longest; whole, the grid would keep one worker busy while the other ran out of files), and
the cases of one world size stay together on one worker.
"""

from __future__ import annotations

import os

import pytest

# run_distributed's ranks fork from a server that imported torch and shardwise's API once
# (shardwise/testing.py); the worker modules of the multi-process tests import pytest too
# (pytest.raises in the ranks): about 1 s of CPU per rank on a loaded machine, paid once here.
os.environ.setdefault("SHARDWISE_TEST_PRELOAD", "pytest")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        group = path
        if path.startswith("tests/dist/fsdp2/"):
            world = getattr(getattr(item, "callspec", None), "params", {}).get("world")
            # 1 and 4 ranks: fewer cases, one group.
            group = "tests/dist/fsdp2" + ("" if world is None else
                                         f"-w{world}" if world in (2, 3) else "-w1-w4")
        item.add_marker(pytest.mark.xdist_group(group))
