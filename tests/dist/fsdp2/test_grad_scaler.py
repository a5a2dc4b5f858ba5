"""Port of upstream test_fully_shard_grad_scaler.py (upstream: 4 ranks), with
sw.ShardedGradScaler instead of torch.amp.GradScaler on DTensor gradients.

Left out: the test_2d=True half (2-D/TP mesh); reading torch.amp.GradScaler's per-device
found_inf state (the port checks the agreed outcome: every rank skips or every rank steps).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import grad_scaler_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

CASES: list[Case] = grid("gradient_scaler", W.gradient_scaler, worlds=(2, 3, 4),
                         has_inf=[True, False])


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_grad_scaler(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
