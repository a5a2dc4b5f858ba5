"""Port of upstream test_fully_shard_autograd.py.

reshard_after_forward=2 (hpZ) runs at 4 ranks (at 2 it is True), in one set of processes:
unused_forward_output and unused_forward_module, with upstream's parity checks plus every
backward all-gather within a 2-rank block (tests/dist/fsdp2/hpz.py). Both models take the
data straight into their linears, whose weights backward never reads (no input gradient):
these cases check which units gather and that unused outputs/units keep working, not the
gathered values (test_mixed_precision.py and test_frozen.py's k=2 cases do).
nontensor_activations has no reshard_after_forward axis upstream.
Left out: TestFullyShardPostAccGradHook* (post-accumulate-grad hooks registered on the
sharded DTensor parameters, which FSDP2 runs after reduce-scatter; shardwise's sharded
parameters get their gradient assigned, so such hooks are an FSDP2-only feature for now).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import autograd_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

BOOLS = [True, False]

CASES: list[Case] = [
    *grid("unused_forward_output", W.unused_forward_output, reshard_after_forward=BOOLS),
    *grid("unused_forward_module", W.unused_forward_module, reshard_after_forward=BOOLS),
    # reshard_after_forward=2 (hpZ), meaningful from 4 ranks on
    Case("unused_forward_output_k2", W.unused_forward_output_hpz, worlds=(4,)),
    Case("unused_forward_module_k2", W.unused_forward_module_hpz, worlds=(4,)),
    *grid("nontensor_activations", W.nontensor_activations,
          container=["list", "namedtuple", "tuple", "dict"]),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_autograd(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
