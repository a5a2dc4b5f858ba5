"""Suite-wide pytest hooks.

[Note: parallel files] `make test` runs test files side by side (pytest-xdist, `--dist
loadgroup`). A file's tests stay on one worker, in order: they share module fixtures and, in
the multi-process files, one process group run for a grid of cases. The ported FSDP2 grid
(tests/dist/fsdp2/) stays whole on one worker: it runs every selected case of a world size in
one run of processes, shared by all of its files.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        group = "tests/dist/fsdp2" if path.startswith("tests/dist/fsdp2/") else path
        item.add_marker(pytest.mark.xdist_group(group))
