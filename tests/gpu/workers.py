"""GPU workers: NCCL parity, CPU offload, bf16 on the device."""

from __future__ import annotations

import copy

import torch

import shardwise as sw
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 4


def parity(rank: int, world: int, strategy: str, offload: bool, mp: str | None) -> float:
    device = torch.device("cuda", rank)
    model = make_model("lm", 0)
    ref = copy.deepcopy(model).to(device)
    ref.head.weight = ref.embed.weight
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                   cpu_offload=offload, mixed_precision=mp)
    for p in model.parameters():
        want = "cpu" if offload else "cuda"
        assert p.device.type == want, (p.device, want)
        if offload:
            assert p.is_pinned()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = make_batch("lm", step, PER_RANK * world)
        x, y = x.to(device), y.to(device)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss_fn("lm", model(x[mine]).float(), y[mine]).backward()
        for p in model.parameters():
            if p.grad is not None:
                assert p.grad.device == p.device
        opt.step()
        opt.zero_grad()
        loss_fn("lm", ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = sw.full_state_dict(model)
    return max((full[n].to(device) - p).abs().max().item() for n, p in ref.named_parameters())
