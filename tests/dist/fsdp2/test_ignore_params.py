"""Port of upstream test_fully_shard_ignore_params.py.

The port keeps the model, the wrapping (module_b and module_b.lin_b sharded, module_c's
parameters ignored, A.addend unmanaged) and the parity checks. Upstream additionally wraps
the model in DDP with the FSDP-managed parameters excluded; since every rank feeds the same
input, that reduction is an identity and is left out (DDP composition is not part of
shardwise's API).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import ignore_params_workers as W
from tests.dist.fsdp2.harness import Case, params_for

CASES: list[Case] = [Case("ddp_A_fsdp_B_ddp_C", W.ddp_a_fsdp_b_ddp_c)]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_ignore_params(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
