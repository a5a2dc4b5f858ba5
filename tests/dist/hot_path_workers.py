"""Workers for issue 43 part 1 (the per-step host work of a unit): the per-layout lists and
views units keep for their per-step loops (unit.py's `UnitHot` / `BucketHot`), the fused
gradient pack and the gradient face written per parameter, held against an unsharded copy."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.engine.core.context import unit_of

PER_RANK = 2
# 5 output rows: split unevenly over 2 ranks (padding rows), evenly over 1.
WIDTHS = (4, 5, 4)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[1]), nn.Tanh()),
                         nn.Sequential(nn.Linear(WIDTHS[1], WIDTHS[2]), nn.Tanh()),
                         nn.Linear(WIDTHS[2], 3))


def _batch(seed: int, world: int) -> torch.Tensor:
    return torch.randn(PER_RANK * world, WIDTHS[0], generator=torch.Generator().manual_seed(seed))


def _backward(model: nn.Module, x: torch.Tensor, rank: int | None) -> None:
    if rank is not None:
        x = x[rank * PER_RANK: (rank + 1) * PER_RANK]
    model(x).square().mean().backward()


def _grad_diffs(ref: nn.Module, model: nn.Module, tag: str) -> dict[str, float]:
    out = {}
    for (name, r), p in zip(ref.named_parameters(), model.parameters()):
        if r.grad is None or p.grad is None:
            out[f"{tag} {name} none"] = 0.0 if (r.grad is None) == (p.grad is None) else 1.0
            continue
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        out[f"{tag} {name}"] = float((p.grad.full_tensor() - r.grad).abs().max())
    return out


def _pair() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The unsharded model, its sharded copy (each block a unit, then the root), SGD each."""
    ref = _model()
    model = copy.deepcopy(ref)
    for block in model[:2]:
        sw.fully_shard(block)
    sw.fully_shard(model)
    return (ref, model, torch.optim.SGD(ref.parameters(), lr=0.1),
            torch.optim.SGD(model.parameters(), lr=0.1))


def semantics(rank: int, world: int) -> dict[str, float]:
    """Gradients accumulated without zero_grad, zeroed in place, set to None; a parameter
    frozen and unfrozen between steps; every value against the unsharded model's."""
    ref, model, ropt, opt = _pair()
    d: dict[str, float] = {}
    # Two backwards without zero_grad: the second adds to the first's gradient.
    for seed in (0, 1):
        _backward(ref, _batch(seed, world), None)
        _backward(model, _batch(seed, world), rank)
    # The reference's loss is the mean over the whole batch, the sharded model's the mean
    # over ranks of each rank's mean over its equal part: the same gradient.
    d.update(_grad_diffs(ref, model, "accumulated"))
    ropt.step()
    opt.step()
    ropt.zero_grad(set_to_none=True)
    opt.zero_grad(set_to_none=True)
    d["none after zero_grad"] = float(sum(p.grad is not None for p in model.parameters()))
    # In-place zeros, then a backward: the gradient is the new one alone.
    _backward(ref, _batch(2, world), None)
    _backward(model, _batch(2, world), rank)
    ropt.zero_grad(set_to_none=False)
    opt.zero_grad(set_to_none=False)
    _backward(ref, _batch(3, world), None)
    _backward(model, _batch(3, world), rank)
    d.update(_grad_diffs(ref, model, "after zeros"))
    ropt.step()
    opt.step()
    ropt.zero_grad()
    opt.zero_grad()
    # Frozen between steps, then unfrozen: no gradient, then the right one.
    for m in (ref, model):
        m[1][0].weight.requires_grad_(False)
    _backward(ref, _batch(4, world), None)
    _backward(model, _batch(4, world), rank)
    d.update(_grad_diffs(ref, model, "frozen"))
    ropt.zero_grad()
    opt.zero_grad()
    for m in (ref, model):
        m[1][0].weight.requires_grad_(True)
    _backward(ref, _batch(5, world), None)
    _backward(model, _batch(5, world), rank)
    d.update(_grad_diffs(ref, model, "unfrozen"))
    return d


def rebuilt_shard_is_gathered(rank: int, world: int) -> dict[str, float]:
    """A shard rebuilt after the per-layout lists were made (new tensors, no set_params):
    the next gather copies from the new shard, not the old one."""
    ref = _model()
    model = copy.deepcopy(ref)
    for block in model[:2]:
        sw.fully_shard(block)
    sw.fully_shard(model)
    x = _batch(0, world)
    _backward(model, x, rank)
    unit = unit_of(model[0])
    assert unit is not None
    before = (unit.hot(), unit.buckets[0].hot())
    sp = unit.params[0]  # blocks 0's weight
    sp._build(sp.padded_shard * 2, meta=False)
    with torch.no_grad():
        ref[0][0].weight.mul_(2)
        got = model(x)
        want = ref(x)
    after = (unit.hot(), unit.buckets[0].hot())
    return {"output": float((got - want).abs().max()),
            "remade": float(sum(a is not b for a, b in zip(before, after)))}


class _Ops(TorchDispatchMode):
    """Counts the aten ops a step dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def one_rank_moves_nothing(rank: int, world: int) -> dict[str, object]:
    """[Note: one rank's parameters] and [Note: one rank's gradients]: on a one-rank mesh a
    step gathers, reduces and frees nothing (the unsharded parameter is the shard's storage,
    autograd's gradient becomes the sharded one), and stays equal to the unsharded model."""
    ref, model, ropt, opt = _pair()
    _backward(ref, _batch(0, world), None)
    _backward(model, _batch(0, world), rank)  # the first step records the order
    ropt.step()
    opt.step()
    ropt.zero_grad()
    opt.zero_grad()
    unit = unit_of(model[0])
    assert unit is not None
    sp = unit.params[0]
    held = sp.padded_shard.untyped_storage().data_ptr()
    shared = []
    # (On the Linear: it runs while its unit is unsharded, before the unit's own hook.)
    model[0][0].register_forward_hook(lambda m, a, o: shared.append(
        m.weight.untyped_storage().data_ptr() == held))
    with _Ops() as ops:
        _backward(model, _batch(1, world), rank)
    _backward(ref, _batch(1, world), None)
    grads = _grad_diffs(ref, model, "handed")
    ropt.step()
    opt.step()
    with torch.no_grad():
        x = _batch(2, world)
        out = float((model(x) - ref(x)).abs().max())
    moved = {k: v for k, v in ops.seen.items()
             if k in ("copy_", "_foreach_copy_", "cat", "split_with_sizes_copy", "empty",
                      "new_empty", "clone", "_to_copy")}
    return {"moved": moved, "shared": shared, "grads": grads, "out": out,
            "storage_kept": sp.padded_shard.untyped_storage().data_ptr() == held}
