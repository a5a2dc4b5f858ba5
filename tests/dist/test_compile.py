"""torch.compile on a sharded model: parity with an unsharded reference, no recompiles.

The recommended order (docs/training.md): shard first, then compile each block
(`block.compile()`) or the whole model; the engine's hooks run eagerly between compiled
pieces ([Note: compile] in engine/core/hooks.py).
"""

from __future__ import annotations

from shardwise.testing import run_distributed
from tests.dist.compile_workers import MODES, compiled_parity


def test_compile_every_order_aot_eager() -> None:
    run_distributed(compiled_parity, 2, "aot_eager", MODES, timeout_s=600)


def test_compile_blocks_after_sharding_inductor_three_ranks() -> None:
    run_distributed(compiled_parity, 3, "inductor", ("blocks_after",), timeout_s=600)
