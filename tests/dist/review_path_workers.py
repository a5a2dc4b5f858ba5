"""Review workers: the forward data path must see every change to the shards.

A unit may stay gathered between forward passes: the root keeps its full parameters after a
forward no backward followed (a grad-enabled validation forward, FSDP2's root rule), units
with reshard_after_forward=False likewise, and set_reshard_after_backward(False) keeps them
after backward. ModelContext.begin_forward reshards such a unit when its shards changed
since the gather, judged by version counters (Unit.shards_changed_since_gather). An in-place
update through `.data` (legacy optimizers, manual SGD, EMA-style `p.data.copy_`) bumps no
version counter, so the next forward computed with the stale full parameters, no error; the
unit now also compares this rank's gathered rows with its shard, and the ranks agree.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw

PER_RANK = 3


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """First dims 3, 1 and 5 (weights), smaller than or not divisible by 2 and 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = Block(5, 3), Block(3, 1)
        self.head = nn.Linear(1, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b2(self.b1(x)))


def _update(params: list[nn.Parameter], how: str, delta: float) -> None:
    if how == "data":
        for p in params:
            p.data.add_(delta)  # the legacy idiom: no autograd, no version bump
    else:
        with torch.no_grad():
            for p in params:
                p.add_(delta)


def sharded_with_ref(model: nn.Module, **kw: object) -> tuple[nn.Module, nn.Module]:
    """An unsharded copy of `model` (built under seed 0), then `model` sharded: blocks
    b1 and b2 as units (with `kw`), the root around them."""
    ref = copy.deepcopy(model)
    for b in (model.b1, model.b2):
        sw.fully_shard(b, **kw)  # type: ignore[arg-type]
    sw.fully_shard(model)
    return model, ref


def stale_after_update(rank: int, world: int, keep: str, how: str) -> list[float]:
    """Max |sharded - unsharded| of the model output, after each of 3 updates.

    keep: "grad_forward" (a grad-enabled forward with no backward, then the update: the
    root keeps its parameters, the blocks too with reshard_after_forward=False), or
    "no_reshard_after_backward" (set_reshard_after_backward(False), forward + backward,
    then the update). how: "data" (p.data.add_) or "no_grad" (p.add_ under no_grad).
    """
    torch.manual_seed(0)
    model, ref = sharded_with_ref(Net(), reshard_after_forward=False)
    if keep == "no_reshard_after_backward":
        model.set_reshard_after_backward(False)
    sharded = list(model.parameters())  # the sharded parameters (what an optimizer holds)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * PER_RANK, 5, generator=g)
    mine = x[rank * PER_RANK:(rank + 1) * PER_RANK]
    diffs = []
    for step in range(3):
        if keep == "grad_forward":
            model.eval()
            model(mine)  # e.g. validation without torch.no_grad(); no backward follows
            model.train()
        else:
            model(mine).sum().backward()
            for p in sharded:
                p.grad = None
        delta = 0.1 * (step + 1)
        _update(sharded, how, delta)
        _update(list(ref.parameters()), "no_grad", delta)
        with torch.no_grad():
            got = model(mine)
            want = ref(mine)
        diffs.append(float((got - want).abs().max()))
    return diffs


def inference_mode_between_steps(rank: int, world: int) -> list[float]:
    """A forward under torch.inference_mode() between training steps: the engine's buffers
    and gathered parameters made there were inference tensors, and the next training step
    raised ("Inplace update to inference tensor outside InferenceMode"). Returns max
    |sharded - unsharded| of the inference output and of the parameters after each step."""
    torch.manual_seed(0)
    model, ref = sharded_with_ref(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    diffs = []
    for _ in range(3):
        x = torch.randn(world * PER_RANK, 5, generator=g)
        mine = x[rank * PER_RANK:(rank + 1) * PER_RANK]
        with torch.inference_mode():  # first of all: the engine allocates its buffers here
            model(mine)
        model(mine).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.inference_mode():
            got, want = model(mine), ref(mine)
        diffs.append(float((got - want).abs().max()))
        full = sw.full_state_dict(model)
        diffs.append(max(float((full[n] - p.detach()).abs().max())
                         for n, p in ref.named_parameters()))
    return diffs
