"""Workers for the deterministic check behind [Note: gloo teardown] (process_group.py).

The exit abort the note describes happens in about 1 launch in 9 without the fix, so a
handful of launches rarely catches a regression. What the fix rests on can be checked on
every run instead: every tensor given to a torch.distributed collective is an alias from
`handoff` (whose death the exit drain waits for), and after `finish()` gloo holds none.
A collective issued around the communication layer breaks the first; a drain that returns
early breaks the second.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.engine.comm import process_group as PG

_OPS = ("all_reduce", "broadcast", "all_to_all_single", "all_gather_into_tensor",
        "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "all_gather",
        "reduce_scatter", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce")


def _watch(seen: dict[str, Any]) -> None:
    """Wrap each torch.distributed collective, wherever shardwise holds a reference to it."""
    originals = {getattr(dist, n): n for n in _OPS if hasattr(dist, n)}

    def checked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen["calls"] += 1
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor) and not any(r() is a for r in PG._handed):
                    seen["bypassed"].append(name)
            return fn(*args, **kwargs)
        return call

    wrapped = {fn: checked(name, fn) for fn, name in originals.items()}
    for name in _OPS:
        if hasattr(dist, name):
            setattr(dist, name, wrapped[getattr(dist, name)])
    # Modules that bound a collective by name at import (work.all_gather_flat, ...).
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("shardwise.") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            try:
                bound = callable(value) and value in wrapped
            except TypeError:  # an unhashable callable (a ctypes function) is no collective
                continue
            if bound:
                setattr(mod, attr, wrapped[value])


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d + 1)
        self.down = nn.Linear(2 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def every_collective_hands_off(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Train, checkpoint and take a full state dict, as benchmarks/exit_user_script.py does."""
    seen: dict[str, Any] = {"calls": 0, "bypassed": []}
    _watch(seen)
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(9) for _ in range(3)), nn.Linear(9, 4))
    sw.shard_model(model, auto_wrap_policy=sw.transformer_policy({_Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(rank * 10 + step))
        model(x).pow(2).mean().backward()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    sw.save_checkpoint(ckpt, model, opt, step=3)
    sw.full_state_dict(model)
    sw.load_checkpoint(ckpt, model, opt)
    PG.finish()
    seen["held_after_finish"] = PG.held_by_gloo()
    return seen


def _watch_dtensor_collectives(seen: dict[str, Any]) -> None:
    """Count DTensor's own collectives (functional collectives), which bypass the layer."""
    import torch.distributed._functional_collectives as funcol

    for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "broadcast", "all_gather_tensor_autograd",
                 "reduce_scatter_tensor_autograd", "all_to_all_single_autograd"):
        fn = getattr(funcol, name, None)
        if fn is None:
            continue

        def call(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name,
                 **kwargs: Any) -> Any:
            seen["dtensor"].append(_name)
            return _fn(*args, **kwargs)

        setattr(funcol, name, call)


def tp_collectives_through_the_layer(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """The trainer's GPT at dp 2 x tp 2: a step, a full state dict, a checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.train.model import GPT, GPTConfig
    from shardwise.train.tensor_parallel import parallelize_gpt

    seen: dict[str, Any] = {"calls": 0, "bypassed": [], "dtensor": []}
    _watch(seen)
    _watch_dtensor_collectives(seen)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=23, block_size=8, n_layer=2, n_head=4, d_model=16))
    parallelize_gpt(model, mesh["tp"])
    sw.shard_model(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    for _ in range(2):
        x = torch.randint(0, 23, (2, 8), generator=g)
        model(x, x).backward()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    sw.full_state_dict(model)
    sw.save_checkpoint(ckpt, model, opt, step=2)
    PG.finish()
    seen["held_after_finish"] = PG.held_by_gloo()
    return seen
