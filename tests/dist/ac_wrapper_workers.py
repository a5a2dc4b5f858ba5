"""Workers for issue 36's activation-checkpointing item: `fully_shard` on torch's
`CheckpointWrapper` whose inner layer is already sharded, as Accelerate's FSDP2 path and
torchtitan-style recipes do it.

The wrapper forwards attribute lookups it cannot answer to the layer inside it, so a sharded
layer's engine attributes showed through the wrapper and shardwise refused the wrapper as
"already sharded". FSDP2 accepts it: the wrapper becomes a unit with no parameters of its own
(they all belong to the inner layer's unit). Each case runs the same recipe on shardwise and
on FSDP2 in the same ranks, against an unsharded model trained on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)

import shardwise as sw
from tests.dist.collective_count_workers import counting

D_IN, D_HID, D_OUT = 7, 9, 5  # no world size of 2 or 3 divides every dim 0
N_LAYERS = 3
BATCH_PER_RANK = 2
STEPS = 3
LR = 0.05
TOL = 1e-6  # float32; sharded and unsharded sums of the same numbers in different orders


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_IN))
            for _ in range(N_LAYERS))
        self.head = nn.Linear(D_IN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _fully_shard(engine: str) -> Callable[..., Any]:
    if engine == "shardwise":
        # Each unit alone: the collectives are counted against FSDP2's ([Note: coalesced
        # units] in engine/core/schedule.py).
        def shard(*args: Any, **kwargs: Any) -> Any:
            return sw.fully_shard(*args, coalesce_bytes=0, **kwargs)

        shard.state = sw.fully_shard.state  # type: ignore[attr-defined]
        return shard
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def build(engine: str, shard_wrapper: bool, reshard_after_forward: bool) -> Net:
    """Each layer sharded, then wrapped in a CheckpointWrapper, the wrapper sharded too when
    `shard_wrapper` (Accelerate's order), then the root."""
    fs = _fully_shard(engine)
    torch.manual_seed(0)
    model = Net()
    for i, layer in enumerate(model.layers):
        fs(layer, reshard_after_forward=reshard_after_forward)
        wrapped = checkpoint_wrapper(layer)
        model.layers[i] = wrapped
        if shard_wrapper:
            fs(wrapped, reshard_after_forward=reshard_after_forward)
    fs(model)
    return model


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * BATCH_PER_RANK, D_IN, generator=g)
    y = torch.randn(world * BATCH_PER_RANK, D_OUT, generator=g)
    if rank < 0:
        return x, y  # the whole batch, for the unsharded reference
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return x[rows], y[rows]


def _full(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model: nn.Module, rank: int, world: int) -> dict[str, Any]:
    """Losses, and every parameter and gradient (full) after each step, by state-dict key."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    names = {id(p): n.replace("_checkpoint_wrapped_module.", "")
             for n, p in model.named_parameters()}
    out: dict[str, Any] = {"loss": [], "grads": [], "params": []}
    for step in range(STEPS):
        x, y = _batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        out["grads"].append({names[id(p)]: _full(p.grad) for p in model.parameters()})
        opt.step()
        opt.zero_grad()
        out["params"].append({names[id(p)]: _full(p) for p in model.parameters()})
        out["loss"].append(loss.detach().clone())
    return out


def _worst(got: dict[str, Any], ref: dict[str, Any]) -> float:
    worst = 0.0
    for step in range(STEPS):
        for what in ("grads", "params"):
            a, b = got[what][step], ref[what][step]
            assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
            worst = max(worst, *((a[k] - b[k]).abs().max().item() for k in a))
    return worst


def _ac_state(engine: str, model: Net) -> list[tuple[bool, bool]]:
    """For each wrapper: (has a state, the state has a parameter group)."""
    fs = _fully_shard(engine)
    out = []
    for w in model.layers:
        assert isinstance(w, CheckpointWrapper), type(w)
        state = fs.state(w)
        out.append((state is not None,
                    state is not None and state._fsdp_param_group is not None))
    return out


def _step_counts(model: nn.Module, rank: int, world: int) -> dict[str, int]:
    """The collectives of one training step after a warm-up step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        x, y = _batch(step, rank, world)
        with counting() as got:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return dict(got["python"])


def wrapper_parity(rank: int, world: int) -> dict[str, Any]:
    """For (wrapper sharded or not) x (reshard_after_forward True/False): shardwise and FSDP2
    against the unsharded reference (max abs difference over every step's parameters and
    gradients), their losses, the wrappers' states, state-dict keys and one step's
    collectives."""
    torch.manual_seed(0)
    reference = _train(Net(), -1, world)
    ref_keys = sorted(Net().state_dict())
    out: dict[str, Any] = {}
    for shard_wrapper in (True, False):
        for raf in (True, False):
            case: dict[str, Any] = {}
            losses = {}
            for engine in ("shardwise", "fsdp2"):
                model = build(engine, shard_wrapper, raf)
                trained = _train(model, rank, world)
                losses[engine] = torch.stack(trained["loss"])
                case[engine] = {
                    "state": _ac_state(engine, model),
                    "keys_match": sorted(model.state_dict()) == ref_keys,
                    "worst": _worst(trained, reference),
                    "counts": _step_counts(build(engine, shard_wrapper, raf), rank, world),
                }
            case["shardwise"]["loss_diff"] = (
                losses["shardwise"] - losses["fsdp2"]).abs().max().item()
            out[f"shard_wrapper={shard_wrapper} reshard_after_forward={raf}"] = case
    return out
