"""GPU parity workers: sharded training against an unsharded reference on the same GPU.

`parity` runs on NCCL, one rank per GPU. `shared_gpu_parity` runs two ranks on ONE GPU over
gloo (NCCL refuses two ranks on one device): each rank selects device 0 and shards with a
CUDA DeviceMesh built over the gloo world, so the units live on the GPU and gloo moves the
flat buffers (core/policies.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from shardwise.engine.core.context import units_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 4
STEPS = 3


def parity(rank: int, world: int, strategy: str, offload: bool, mp: str | None) -> float:
    """NCCL (the rank's own GPU): the largest parameter difference after STEPS steps."""
    device = torch.device("cuda", rank)
    model = make_model("lm", 0)
    ref = copy.deepcopy(model).to(device)
    ref.head.weight = ref.embed.weight
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                   cpu_offload=offload, mixed_precision=mp)
    return _train_and_compare(model, ref, device, rank, world, offload)


def shared_gpu_parity(rank: int, world: int, strategy: str, offload: bool) -> dict:
    """gloo, every rank on cuda:0: the largest difference and what the engine chose."""
    # Selected before the mesh: init_device_mesh only picks a device (LOCAL_RANK, which is
    # 1 on the second rank and does not exist on a one-GPU machine) when none was selected.
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    mesh = init_device_mesh("cuda", (world,))
    model = make_model("lm", 0)
    ref = copy.deepcopy(model).to(device)
    ref.head.weight = ref.embed.weight
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                   cpu_offload=offload, mesh=mesh)
    units = units_of(model)
    worst = _train_and_compare(model, ref, device, rank, world, offload)
    return {
        "worst": worst,
        "unit_devices": sorted({str(u.mesh.device) for u in units}),
        "transports": sorted({u.mesh.transport.name for u in units}),
        "backend": torch.distributed.get_backend(units[0].mesh.shard_group),
    }


def _train_and_compare(model: nn.Module, ref: nn.Module, device: torch.device, rank: int,
                       world: int, offload: bool) -> float:
    """STEPS AdamW steps of `model` (this rank's slice of the batch) and `ref` (the whole
    batch); the largest absolute difference of any parameter at the end."""
    for p in model.parameters():
        want = "cpu" if offload else "cuda"
        assert p.device.type == want, (p.device, want)
        if offload:
            assert p.is_pinned()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = make_batch("lm", step, PER_RANK * world)
        x, y = x.to(device), y.to(device)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss_fn("lm", model(x[mine]).float(), y[mine]).backward()
        for p in model.parameters():
            if p.grad is not None:
                assert p.grad.device == p.device, (p.grad.device, p.device)
        opt.step()
        opt.zero_grad()
        loss_fn("lm", ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = sw.full_state_dict(model)
    return max((full[n].to(device) - p).abs().max().item() for n, p in ref.named_parameters())


def shared_gpu_scaler(rank: int, world: int, trials: int) -> list[bool]:
    """ShardedGradScaler on two ranks sharing one GPU: rank 1 alone finds an inf in its
    shard of the gradients for `trials` steps, then one clean step. Returns, per step,
    whether this rank's optimizer stepped; every rank must agree (skip, ..., skip, step)."""
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world,))
    device = torch.device("cuda", 0)
    model = make_model("lm", 0)
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer",
                   mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = sw.ShardedGradScaler(init_scale=2.0**4)
    stepped = []
    for step in range(trials + 1):
        x, y = make_batch("lm", step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = loss_fn("lm", model(x[mine].to(device)).float(), y[mine].to(device))
        scaler.scale(loss).backward()
        if rank == 1 and step < trials:
            with torch.no_grad():
                g = next(g for g in (p.grad.to_local() for p in model.parameters()
                                     if p.grad is not None) if g.numel())
                g.view(-1)[0] = float("inf")
        stepped.append(scaler.step(opt))
        scaler.update()
        opt.zero_grad()
    return stepped
