"""Scenarios of upstream test_fully_shard_autograd.py: unused forward outputs, unused
units, activations wrapped in containers."""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch
from torch import nn

import shardwise as sw
from tests.dist.fsdp2.common import Expect, check_sharded_parity, global_batch, ref_step
from tests.dist.fsdp2.hpz import in_blocks
from tests.dist.fsdp2.models import DoubleLinear

DIM = 7


def _rand(g: torch.Generator) -> torch.Tensor:
    return torch.rand((2, DIM), generator=g)


def unused_forward_output(rank: int, world: int, ex: Expect,
                          reshard_after_forward: bool | int) -> None:
    """Both outputs in the loss for 3 iterations, then only the first: the second linear's
    parameters get no gradient (None, not zeros) once they stop being used."""
    torch.manual_seed(42)
    model = DoubleLinear(DIM, use_second_linear=True)
    ref = copy.deepcopy(model)
    sw.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    sw.fully_shard(model, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(8):
        def loss_of(m: nn.Module, x: torch.Tensor, it: int = it) -> torch.Tensor:
            out1, out2 = m(x)
            return (out1 * out2).sum() if it < 3 else out1.sum()

        xs = global_batch(it, world, _rand)
        loss = loss_of(model, xs[rank])
        loss.backward()
        ex.close(loss, ref_step(ref, xs, loss_of)[rank], f"iter {it}: loss")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))
    check_sharded_parity(ex, ref, model, rank, world, "after training")


def unused_forward_module(rank: int, world: int, ex: Expect,
                          reshard_after_forward: bool | int) -> None:
    """A unit that never runs forward: its parameters keep None gradients and never move."""
    torch.manual_seed(42)
    model = DoubleLinear(DIM, use_second_linear=False)
    ref = copy.deepcopy(model)
    for m in (model.lin1, model.lin2, model):
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward)
    _train_sum_loss(rank, world, ex, model, ref, 6)


# reshard_after_forward=2 at 4 ranks, backward gathering within 2-rank blocks (hpz.py)
unused_forward_output_hpz = in_blocks(unused_forward_output, __name__)
unused_forward_module_hpz = in_blocks(unused_forward_module, __name__)


def _train_sum_loss(rank: int, world: int, ex: Expect, model: nn.Module, ref: nn.Module,
                    iters: int) -> None:
    """Adam on both, loss = sum of outputs; parity of loss, parameters and gradients each
    iteration (zero_grad alternates between None and zeros)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(iters):
        xs = global_batch(it, world, _rand)
        loss = model(xs[rank]).sum()
        loss.backward()
        ex.close(loss, ref_step(ref, xs, lambda m, x: m(x).sum())[rank], f"iter {it}: loss")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


NT = collections.namedtuple("NT", "x y")


class _Block(nn.Module):
    """Takes and returns the same container type, with the tensor at position/key 0/'x'."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)
        self.relu = nn.ReLU()

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.lin2(self.relu(self.lin1(x))))

    def forward(self, inp: Any) -> Any:
        if isinstance(inp, NT):
            return NT(self._f(inp.x), inp.y)
        if isinstance(inp, list):
            return [self._f(inp[0])]
        if isinstance(inp, tuple):
            return (self._f(inp[0]),)
        return {"x": self._f(inp["x"])}


class _Pack(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return {"list": lambda: [x], "namedtuple": lambda: NT(x, torch.ones_like(x)),
                "tuple": lambda: (x,), "dict": lambda: {"x": x}}[self.kind]()


class _Unpack(nn.Module):
    def forward(self, inp: Any) -> torch.Tensor:
        return inp["x"] if isinstance(inp, dict) else inp[0]


def nontensor_activations(rank: int, world: int, ex: Expect, container: str) -> None:
    """Activations between units wrapped in list / namedtuple / tuple / dict."""
    torch.manual_seed(42)
    model = nn.Sequential(_Pack(container), _Block(), _Block(), _Block(), _Unpack())
    ref = copy.deepcopy(model)
    for m in [*model, model]:
        sw.fully_shard(m)
    _train_sum_loss(rank, world, ex, model, ref, 5)
