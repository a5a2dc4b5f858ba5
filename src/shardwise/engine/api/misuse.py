"""Loud failures for mistakes that would otherwise train silently wrong."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_registered = False


def watch_optimizers() -> None:
    """Install (once) a check that no optimizer steps parameters replaced by sharding.

    fully_shard swaps each original parameter for a sharded one and empties the original.
    An optimizer built before sharding still holds the originals, which never get a
    gradient again: its step would do nothing, every step, without a word.
    """
    global _registered
    if _registered or os.environ.get("SHARDWISE_CHECK_OPTIMIZERS", "1") == "0":
        return
    _registered = True
    # The one process-wide hook shardwise installs (docs/design.md, "Global effects"): torch
    # has no per-parameter step hook, and an optimizer built before sharding cannot be told
    # apart from the parameters alone. It costs one attribute read per step once checked.
    register_optimizer_step_pre_hook(_check_step)


def _check_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    n = sum(len(g["params"]) for g in opt.param_groups)
    if getattr(opt, "_sw_checked", None) == n:
        return  # checked these parameters already (a new group changes the count)
    for g in opt.param_groups:
        for p in g["params"]:
            sp = getattr(p, "_sw_orig_of", None)
            if sp is not None:
                raise RuntimeError(
                    f"{type(opt).__name__} was built before sharding: it holds the original "
                    f"parameter {sp.fqn!r}, which sharding replaced, so its step would train "
                    "nothing. Build the optimizer after shard_model/fully_shard (from "
                    "model.parameters()), and after sw.materialize for meta-device models")
    opt._sw_checked = n  # type: ignore[attr-defined]
