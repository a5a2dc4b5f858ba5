"""Review: 0-d parameters through torch's state-dict tools (review_state_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_state_workers as W


def test_zero_dim_param_full_state_dict_holds_the_value_on_every_rank() -> None:
    for res in run_distributed(W.zero_dim_full_state_dict, 2):
        assert res["shape"] == [] and res["values"] == [pytest.approx(res["ref"])], res


def test_zero_dim_param_dcp_keeps_the_value_across_world_sizes(tmp_path: Path) -> None:
    path = str(tmp_path / "dcp")
    res = run_distributed(W.zero_dim_dcp_save, 2, path)
    assert res[0]["saved_shape"] == [], res
    for gate in run_distributed(W.zero_dim_dcp_load, 3, path):
        assert gate == pytest.approx(0.25), gate
