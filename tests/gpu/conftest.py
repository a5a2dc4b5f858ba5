from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (opt-in GPU tests; run them where a GPU exists)")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
