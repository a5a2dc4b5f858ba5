"""Issue 14: PyTorch's own tools on a sharded model, each against an unsharded reference.

The model has dim-0 sizes that do not divide the world size (7 rows at 2 and 3 ranks) and a
parameter whose last shard is empty (2 rows at 3 ranks). Every rank trains on its slice of
one global batch of 6 samples; the reference trains on all 6 in one process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardwise as sw
from shardwise.engine.core.context import named_sharded_params

BATCH = 12  # global samples per step: divides 2, 3 and 4 ranks
TOL = 1e-5


def make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # dim 0: 7 (4+3 at 2 ranks; 3+3+1 at 3), 2 (1+1+0 at 3 ranks: an empty shard).
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)


def shard(model: nn.Module, mesh: object | None = None) -> nn.Module:
    for m in model:
        if isinstance(m, nn.Linear):
            sw.fully_shard(m, mesh=mesh)
    sw.fully_shard(model, mesh=mesh)
    # PyTorch's own code (DCP helpers, clip_grad_norm_) sees torch FSDPModules here.
    assert all(isinstance(m, FSDPModule) for m in [model, *model] if sw.fully_shard.state(m))
    return model


def backward(model: nn.Module, step: int, rank: int, world: int) -> None:
    x, y = batch(step)
    n = BATCH // world
    mine = slice(rank * n, (rank + 1) * n)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()


def ref_backward(ref: nn.Module, step: int) -> None:
    x, y = batch(step)
    nn.functional.mse_loss(ref(x), y).backward()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (full(a).detach().cpu() - b.detach().cpu()).abs().max().item()
    assert diff < TOL, f"{what} differs by {diff}"


def hybrid_mesh(world: int) -> object:
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def clip_and_state_dict(rank: int, world: int, hybrid: bool) -> None:
    """DTensor parameters sharing the shard's storage; clip_grad_norm_; state_dict round trip."""
    model = make(0)
    ref = copy.deepcopy(model)
    mesh = hybrid_mesh(world) if hybrid else None
    shard(model, mesh)
    want = (Replicate(), Shard(0)) if hybrid else (Shard(0),)
    for fqn, sp in named_sharded_params(model):
        p = dict(model.named_parameters())[fqn]
        assert isinstance(p, DTensor) and tuple(p.placements) == want, (fqn, type(p))
        assert p.shape == sp.orig_shape and p.to_local().shape == sp.local.shape
        if sp.local_rows:  # the DTensor's local tensor is the engine's shard, not a copy
            assert p.to_local().data_ptr() == sp.padded_shard.data_ptr(), fqn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    refp = dict(ref.named_parameters())
    for step in range(2):
        backward(model, step, rank, world)
        ref_backward(ref, step)
        for name, p in model.named_parameters():
            assert isinstance(p.grad, DTensor) and tuple(p.grad.placements) == want, name
            close(p.grad, refp[name].grad, f"step {step} grad {name}")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        close(norm, ref_norm, f"step {step} clip_grad_norm_ total norm")
        assert ref_norm > 0.05, "the test must clip"
        for name, p in model.named_parameters():
            close(p.grad, refp[name].grad, f"step {step} clipped grad {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert isinstance(sd[k], DTensor), k
        close(sd[k], v, f"model.state_dict()[{k!r}]")
    # load_state_dict with DTensors writes into the shards.
    other = make(7).state_dict()
    dsd = {k: distribute_tensor(v, sd[k].device_mesh, sd[k].placements)
           for k, v in other.items()}
    model.load_state_dict(dsd)
    got = sw.full_state_dict(model)
    for k, v in other.items():
        close(got[k], v, f"load_state_dict {k}")


def dcp_state_dicts(rank: int, world: int) -> None:
    """get/set_model_state_dict and get/set_optimizer_state_dict, sharded and full."""
    model, ref = make(0), make(0)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    backward(model, 0, rank, world)
    ref_backward(ref, 0)
    opt.step()
    ref_opt.step()
    ref_opt.zero_grad()
    # full_state_dict + cpu_offload: rank 0 gets full CPU tensors, the others nothing.
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=full_opts)
    osd = get_optimizer_state_dict(model, opt, options=full_opts)
    refp = dict(ref.named_parameters())
    if rank == 0:
        for k, v in ref.state_dict().items():
            assert not isinstance(msd[k], DTensor) and msd[k].device.type == "cpu", k
            close(msd[k], v, f"get_model_state_dict(full) {k}")
        for fqn, st in osd["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                close(st[name], ref_opt.state[refp[fqn]][name], f"full optimizer {fqn}.{name}")
        assert set(osd["state"]) == set(refp)
    else:
        assert msd == {} and osd == {} or not osd.get("state"), (list(msd), list(osd))
    full_nooffload = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for k, v in ref.state_dict().items():  # without cpu_offload: every rank
        close(full_nooffload[k], v, f"get_model_state_dict(full, every rank) {k}")
    sharded_osd = get_optimizer_state_dict(model, opt)
    for fqn, st in sharded_osd["state"].items():
        assert isinstance(st["exp_avg"], DTensor), fqn
        close(st["exp_avg"], ref_opt.state[refp[fqn]]["exp_avg"], f"sharded optim {fqn}")

    # Into a fresh model: full model state, full optimizer state, then one more step each.
    fresh = shard(make(3))
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, msd, options=from_rank0)
    set_optimizer_state_dict(fresh, fopt, osd, options=from_rank0)
    backward(fresh, 1, rank, world)
    ref_backward(ref, 1)
    fopt.step()
    ref_opt.step()
    got = sw.full_state_dict(fresh)
    for k, v in ref.state_dict().items():
        close(got[k], v, f"after set_*_state_dict(full) and one step: {k}")
    # And the sharded (DTensor) model state dict, back into the first model.
    set_model_state_dict(model, get_model_state_dict(fresh))
    got = sw.full_state_dict(model)
    for k, v in ref.state_dict().items():
        close(got[k], v, f"set_model_state_dict(sharded) {k}")


def dcp_save(rank: int, world: int, path: str) -> None:
    """One step at this world size, then dcp.save model and optimizer."""
    model = shard(make(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backward(model, 0, rank, world)
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load_and_step(rank: int, world: int, path: str) -> None:
    """dcp.load at this (maybe different) world size, one more step: parity with a run that
    never stopped."""
    ref = make(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        ref_backward(ref, step)
        ref_opt.step()
        ref_opt.zero_grad()
    model = shard(make(5))  # different initial weights: everything must come from the load
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    backward(model, 1, rank, world)
    opt.step()
    got = sw.full_state_dict(model)
    for k, v in ref.state_dict().items():
        close(got[k], v, f"dcp load at {world} ranks, one more step: {k}")
