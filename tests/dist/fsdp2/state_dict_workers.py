"""Scenarios of upstream test_fully_shard_state_dict.py, through shardwise's full state
dict API (sw.full_state_dict / sw.load_full_state_dict): save/load round trips, a model
that kept its parameters after forward, meta-device + CPU offload loading in pieces, and a
rank-0-only state dict."""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw
from tests.dist.fsdp2.common import Expect
from tests.dist.fsdp2.models import MLP, ModelArgs, Transformer, transformer_blocks


def _base(dim: int) -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(MLP(dim), nn.Sequential(MLP(dim), nn.Linear(dim, dim)), MLP(dim))


def _new_values(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A full state dict with fresh values (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def _round_trip(ex: Expect, model: nn.Module, base: nn.Module, what: str) -> None:
    keys = list(base.state_dict().keys())
    ones = {k: torch.ones_like(v) for k, v in base.state_dict().items()}
    sw.load_full_state_dict(model, ones)
    sd = sw.full_state_dict(model)
    ex.true(list(sd.keys()) == keys, f"{what}: keys {list(sd.keys())} != {keys}")
    for k, v in sd.items():
        ex.true(v.device.type == "cpu", f"{what}: {k} on {v.device}")
        ex.close(v, ones[k], f"{what}: {k} after loading ones")
    new = _new_values(base, 5)
    sw.load_full_state_dict(model, new)
    for k, v in sw.full_state_dict(model).items():
        ex.close(v, new[k], f"{what}: {k} after loading new values")
    ref = copy.deepcopy(base)
    ref.load_state_dict(new)
    x = torch.randn(2, next(iter(new.values())).shape[-1])
    ex.close(model(x), ref(x), f"{what}: forward with the loaded values")


def dp_state_dict_save_load(rank: int, world: int, ex: Expect) -> None:
    for dim in (2, 3, 4, 5):
        base = _base(dim)
        model1 = copy.deepcopy(base)
        for m in [*model1, model1]:
            sw.fully_shard(m)
        _round_trip(ex, model1, base, f"dim {dim}, reshard_after_forward=True")

        model2 = copy.deepcopy(base)
        for m in [*model2, model2]:
            sw.fully_shard(m, reshard_after_forward=False)
        _round_trip(ex, model2, base, f"dim {dim}, reshard_after_forward=False")
        before = sw.full_state_dict(model2)
        model2(torch.randn(2, dim))  # parameters stay unsharded after this forward
        after = sw.full_state_dict(model2)
        ex.true(list(after.keys()) == list(before.keys()), f"dim {dim}: keys changed")
        for k, v in before.items():
            ex.close(after[k], v, f"dim {dim}: {k} after a forward that kept parameters")


def load_after_forward_without_backward(rank: int, world: int, ex: Expect,
                                        reshard_after_forward: bool) -> None:
    """Loading a full state dict after a grad-enabled forward with no backward must take
    effect in the next forward (issue 12, defect 4), or be refused with a clear error."""
    dim = 5
    base = _base(dim)
    model = copy.deepcopy(base)
    for m in [*model, model]:
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward)
    x = torch.randn(2, dim)
    model(x)  # no backward follows
    new = _new_values(base, 11)
    try:
        sw.load_full_state_dict(model, new)
    except (RuntimeError, ValueError):
        return  # refused: allowed
    ref = copy.deepcopy(base)
    ref.load_state_dict(new)
    ex.close(model(x), ref(x), "forward after loading")
    for k, v in sw.full_state_dict(model).items():
        ex.close(v, new[k], f"{k} after loading")


def dp_state_dict_cpu_offload(rank: int, world: int, ex: Expect) -> None:
    """A meta-device model with CPU offload, loaded one parameter at a time (strict=False),
    runs a forward; its state dict is on the CPU."""
    dim = 4
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False))
    policy = sw.CPUOffloadPolicy(pin_memory=False)
    for m in [*model, model]:
        sw.fully_shard(m, offload_policy=policy)
    g = torch.Generator().manual_seed(3)
    full = {name: torch.randn(dim, dim, generator=g) for name in ("0.weight", "1.weight")}
    for name, t in full.items():
        sw.load_full_state_dict(model, {name: t}, strict=False)
    x = torch.rand(dim, dim)
    ref = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False))
    ref.load_state_dict(full)
    ex.close(model(x).sum(), ref(x).sum(), "forward after loading in pieces")
    for k, v in sw.full_state_dict(model).items():
        ex.true(v.device.type == "cpu", f"{k} on {v.device}")
        ex.close(v, full[k], f"{k}")


def rank0_offload_full_state_dict(rank: int, world: int, ex: Expect) -> None:
    torch.manual_seed(42)
    ref = Transformer(ModelArgs())
    model = copy.deepcopy(ref)
    for m in [*transformer_blocks(model), model]:
        sw.fully_shard(m)
    sd = sw.full_state_dict(model, rank0_only=True)
    if rank != 0:
        ex.true(len(sd) == 0, f"rank {rank} got {len(sd)} entries")
        return
    ref_sd = ref.state_dict()
    ex.true(list(sd.keys()) == list(ref_sd.keys()), "keys differ from the reference's")
    for k, v in ref_sd.items():
        if k in sd:
            ex.true(sd[k].device.type == "cpu", f"{k} on {sd[k].device}")
            ex.close(sd[k], v, k)


def dp_state_dict_dtensors(rank: int, world: int, ex: Expect) -> None:
    """Upstream's DTensor half of test_dp_state_dict_save_load: `model.state_dict()` values
    are DTensors sharing storage with the sharded parameters, even right after a forward
    that kept the parameters (FSDP2's state-dict hooks reshard first); loading that state
    dict into a fresh sharded model gives the same values."""
    from torch.distributed.tensor import DTensor

    for dim in (2, 3, 4, 5):
        base = _base(dim)
        for raf in (None, True, False):
            model = copy.deepcopy(base)
            for m in [*model, model]:
                sw.fully_shard(m, reshard_after_forward=raf)
            model(torch.randn(2, dim))  # a forward with no backward
            sd = model.state_dict()
            params = dict(model.named_parameters())
            what = f"dim {dim}, reshard_after_forward={raf}"
            for k, v in sd.items():
                ex.true(isinstance(v, DTensor), f"{what}: {k} is a {type(v).__name__}")
                if not isinstance(v, DTensor):
                    continue
                p = params[k]
                ex.true(isinstance(p, DTensor) and v.to_local().data_ptr()
                        == p.to_local().data_ptr(), f"{what}: {k} does not share storage")
                ex.close(v.full_tensor(), base.state_dict()[k], f"{what}: {k}")
            fresh = copy.deepcopy(_base(dim))
            for m in [*fresh, fresh]:
                sw.fully_shard(m)
            fresh.load_state_dict(sd)
            for k, v in sw.full_state_dict(fresh).items():
                ex.close(v, base.state_dict()[k], f"{what}: {k} loaded from DTensors")
