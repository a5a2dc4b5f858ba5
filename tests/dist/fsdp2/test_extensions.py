"""Port of upstream test_fully_shard_extensions.py. The monkey-patch recipe
(test_all_gather_extensions_monkey_patch: meta init, to_empty, hooks patched onto the local
shards, which pad uneven shards as test_all_gather_extension_outer_size_stride's subclass
does, and see the 1-D shard mesh as test_all_gather_extension_hsdp_mesh checks) trains as
the unsharded reference. TwoTensor weights without hooks, and hooks set before sharding, are
refused by name before any collective.

The train-parity scenario with a subclass that implements the hooks, mixed precision, CPU
offload, both hook signatures and uneven shards, run against torch's FSDP2 itself, is in
tests/dist/test_all_gather_extensions.py (SplitTensor, torchao's NF4 and float8). Left out:
test_all_gather_extensions_end_to_end (meta init of subclass parameters: refused by name).
"""

from __future__ import annotations

import pytest

from tests.dist.fsdp2 import extensions_workers as W
from tests.dist.fsdp2.harness import Case, grid, params_for

CASES: list[Case] = [
    *grid("all_gather_extension_refused", W.subclass_param_refused,
          kind=["two_tensor", "hooks"]),
    Case("all_gather_extension_monkey_patch", W.patched_after_to_empty),
]


@pytest.mark.parametrize("case,world", params_for(CASES))
def test_fully_shard_extensions(case: Case, world: int, fsdp2) -> None:
    fsdp2.check(case, world)
