"""Scenario of upstream test_fully_shard_ignore_params.py: A(B(C)) with B and B.lin_b
sharded and C's parameters ignored (left whole, like A's own parameter)."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from tests.dist.fsdp2.common import Expect


class C(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim: int, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = C(dim)
        self.subtrahend = nn.Parameter(subtrahend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim: int, addend: torch.Tensor, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.module_b = B(dim, subtrahend)
        self.addend = nn.Parameter(addend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


def _model_and_input() -> tuple[A, torch.Tensor]:
    dim = 7
    torch.manual_seed(42)
    addend = torch.randn(dim, dim)
    torch.manual_seed(70)
    subtrahend = torch.randn(dim, dim)
    model = A(dim, addend, subtrahend)
    torch.manual_seed(84)
    return model, torch.randn(dim, dim)


def ddp_a_fsdp_b_ddp_c(rank: int, world: int, ex: Expect) -> None:
    """Every rank feeds the same input (as upstream does), so the parameters that no unit
    owns need no gradient reduction: DDP's part of upstream's test is not needed here."""
    ref, ref_inp = _model_and_input()
    model, inp = _model_and_input()
    ignored = set(model.module_b.module_c.parameters())
    sw.fully_shard(model.module_b.lin_b, ignored_params=ignored)
    sw.fully_shard(model.module_b, ignored_params=ignored)
    sharded = {n for n, m in model.named_modules() if isinstance(m, sw.ShardedModule)}
    ex.true(sharded == {"module_b", "module_b.lin_b"}, f"sharded modules {sharded}")
    for p, rp in zip(model.module_b.module_c.parameters(), ref.module_b.module_c.parameters()):
        ex.true(p.shape == rp.shape, f"ignored parameter sharded: {tuple(p.shape)}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(3):
        loss, ref_loss = model(inp), ref(ref_inp)
        ex.close(loss, ref_loss, f"iter {it}: loss")
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        full = sw.full_state_dict(model)
        for n, rp in ref.named_parameters():
            ex.close(full[n], rp.detach(), f"iter {it}: {n}")
