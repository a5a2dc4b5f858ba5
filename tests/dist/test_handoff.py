"""Every collective goes through the exit drain's handoff, and finish() leaves gloo holding
nothing: the deterministic form of the exit test (tests/e2e/test_exit.py launches the user
script a few times; benchmarks/exit_stress.py measures the abort rate over hundreds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import handoff_workers


@pytest.mark.parametrize("world,native", [(2, False), (3, True)])
def test_every_collective_is_handed_off(tmp_path: Path, world: int, native: bool) -> None:
    env = {"SHARDWISE_GLOO_NATIVE": "1"} if native else None
    for seen in run_distributed(handoff_workers.every_collective_hands_off, world,
                                str(tmp_path / "ckpt"), env=env):
        assert seen["calls"] > 20, seen["calls"]
        assert seen["bypassed"] == [], f"collectives given a tensor not from handoff: " \
                                       f"{sorted(set(seen['bypassed']))}"
        assert seen["held_after_finish"] == 0


def test_tensor_parallel_collectives_go_through_the_layer(tmp_path: Path) -> None:
    # Before: the TP plan's f/g and the engine's TP gradient and full-tensor paths used
    # DTensor's own collectives, with no exit-drain alias, fingerprint or named error.
    for seen in run_distributed(handoff_workers.tp_collectives_through_the_layer, 4,
                                str(tmp_path / "ckpt")):
        assert seen["dtensor"] == [], sorted(set(seen["dtensor"]))
        assert seen["calls"] > 20 and seen["bypassed"] == [], seen["bypassed"]
        assert seen["held_after_finish"] == 0
