"""Workers for the one-copy release ([Note: one-copy release] in engine/comm/one_copy.py):
a rank goes on once its own receives are in, while its peer may still read what it sent."""

from __future__ import annotations

import copy
import time

import torch

import shardwise as sw
from shardwise.engine.comm import one_copy_setup
from tests.dist import one_copy_workers as W
from tests.models import TinyLM


def _lag(module: torch.nn.Module, seconds: float) -> None:
    """Make this rank late inside `module`'s forward and backward (not a unit itself)."""
    module.register_forward_pre_hook(lambda m, a: time.sleep(seconds))
    module.register_full_backward_pre_hook(lambda m, g: time.sleep(seconds))


def lagging_peer(rank: int, world: int, strategy: str, late: int,
                 lag_s: float) -> dict[str, object]:
    """Three SGD steps of a TinyLM wide enough that its larger weights travel as messages
    of their own (the rest in the small pack), with rank `late` sleeping inside every block's
    forward and backward: the other rank reshards, reuses pooled buffers and frees gathered
    rows while `late` has still to read them. Against the unsharded reference, and every full
    parameter after the steps (to compare with the gloo path bit for bit)."""
    torch.manual_seed(3)
    model = TinyLM(d=256)
    ref = copy.deepcopy(model)
    ref.head.weight = ref.embed.weight
    if rank == late:
        for b in model.blocks:
            _lag(b.up, lag_s)
            _lag(b.down, lag_s)
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
    # SGD: at d=256 AdamW's first steps amplify the reference's summation-order differences
    # in near-zero gradients (to 5e-5, the gloo path alike); the bits are compared with
    # gloo's below.
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    out = W.steps_against_reference(model, ref, opt, ref_opt, rank, world, per_rank=2,
                                    seed=70)
    channel = one_copy_setup._channels.get(torch.distributed.group.WORLD)
    return {**out, "held": 0 if channel is None else len(channel.exchanges)}
