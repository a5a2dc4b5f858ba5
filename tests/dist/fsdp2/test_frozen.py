"""Port of upstream test_fully_shard_frozen.py.

Not ported: the count of post-backward calls made through the autograd function
(RegisterPostBackwardFunction is FSDP2-internal); the parity and reduce-scatter size checks
of the same tests are ported. Upstream's across-groups helper freezes only `seq[i % 2]`;
the port freezes every other Linear as its comment intends, and adds the root call that
shardwise's contract asks for.
reshard_after_forward=2 (hpZ) runs at 4 ranks (at 2 it is True), in one set of processes,
for all three scenarios and every upstream combination of the other axes (each case takes
under a second once the processes run): parity and the reduce-scatter sizes as above, plus
backward's all-gathers within 2-rank blocks (tests/dist/fsdp2/hpz.py); in
multi_forward_mixed_requires_grad only some of them, since layer_with_grad's last use in a
forward runs under no_grad, after which shardwise reshards fully ([Note: hpZ]).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import frozen_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]

CASES: list[Case] = [
    *grid("train_mixed_requires_grad_per_group", W.mixed_requires_grad_per_group,
          reshard_after_forward=BOOLS, activation_checkpointing=[False, True],
          freeze_after_init=[False, True]),
    *grid("train_mixed_requires_grad_across_groups", W.mixed_requires_grad_across_groups,
          reshard_after_forward=BOOLS, unfreeze_params=[False, True]),
    *grid("multi_forward_mixed_requires_grad", W.multi_forward_mixed_requires_grad,
          reshard_after_forward=BOOLS),
    # reshard_after_forward=2 (hpZ), meaningful from 4 ranks on
    *grid("train_mixed_requires_grad_per_group_k2", W.mixed_requires_grad_per_group_hpz,
          worlds=(4,), activation_checkpointing=[False, True], freeze_after_init=[False, True]),
    *grid("train_mixed_requires_grad_across_groups_k2", W.mixed_requires_grad_across_groups_hpz,
          worlds=(4,), unfreeze_params=[False, True]),
    Case("multi_forward_mixed_requires_grad_k2", W.multi_forward_mixed_requires_grad_hpz,
         worlds=(4,)),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_frozen(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
