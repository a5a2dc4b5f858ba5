"""Workers for issue 36's `patch_fsdp2()` item: FSDP2 itself still works while patched.

The patch rebinds `fully_shard` in the module that defines FSDP2's function too, and FSDP2's
function finds its own state through that module global (`fully_shard.state(module)`). So
while patched, FSDP2 called through a reference taken before the patch reads its state through
shardwise's `fully_shard.state`, which must answer with FSDP2's state for a module FSDP2
shards.
"""

from __future__ import annotations

from typing import Any

import torch

import shardwise as sw
from tests.dist import ac_wrapper_workers as W


def fsdp2_while_patched(rank: int, world: int) -> dict[str, Any]:
    # Taken here, not as a module global: the patch would rebind a global of this module.
    from torch.distributed.fsdp import fully_shard as fsdp2
    from torch.distributed.fsdp._fully_shard import _fully_shard as impl

    torch.manual_seed(0)
    reference = W._train(W.Net(), -1, world)
    with sw.patched_fsdp2():
        rebound = impl.fully_shard is sw.fully_shard
        torch.manual_seed(0)
        model = W.Net()
        for layer in model.layers:
            fsdp2(layer)
        fsdp2(model)
        state = sw.fully_shard.state(model)
        worst = W._worst(W._train(model, rank, world), reference)
    return {"rebound": rebound, "state": type(state).__name__,
            "layer_state": type(sw.fully_shard.state(model.layers[0])).__name__,
            "worst": worst}
