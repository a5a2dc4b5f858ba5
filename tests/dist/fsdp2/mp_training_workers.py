"""Scenarios of upstream test_fully_shard_mixed_precision.py (TestFullyShardMixedPrecision
Training): compute and reduce dtypes, accumulation with an fp32 reduce dtype, structured
activations.

The reference reproduces mixed precision exactly, as upstream's does: a copy of the model in
the compute dtype runs each rank's slice; each rank's gradient is cast to the reduce dtype,
the ranks' gradients are summed in rank order and divided by the world size in the reduce
dtype (docs/design.md: "sum then divide"), and an fp32 optimizer steps fp32 master weights.
So fp32 tolerances hold for the parameters, as upstream checks.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

import shardwise as sw
from shardwise.engine.core.dtensor import local_of
from tests.dist.fsdp2.common import Expect, check_sharded_parity, global_batch, randn
from tests.dist.fsdp2.common import record_collectives as record
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.hpz import in_blocks
from tests.dist.fsdp2.models import MLP

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}




class Reference:
    """fp32 master copy + compute-dtype copy, reproducing sharded mixed precision."""

    def __init__(self, model: nn.Module, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, world: int) -> None:
        self.master = copy.deepcopy(model)
        self.compute = copy.deepcopy(model).to(param_dtype or torch.float32)
        self.pd = param_dtype or torch.float32
        self.rd = reduce_dtype or self.pd
        self.world = world
        self.opt = torch.optim.Adam(self.master.parameters(), lr=1e-2)

    def rank_grads(self, x: Any, loss_of: Callable[[nn.Module, Any], torch.Tensor]
                   ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        self.compute.zero_grad(set_to_none=True)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(self.pd)  # what the root's cast_forward_inputs does
        loss = loss_of(self.compute, x)
        loss.backward()
        return loss.detach(), [p.grad for p in self.compute.parameters()]

    def reduce(self, per_rank: list[list[torch.Tensor | None]]) -> None:
        """Sum the ranks' gradients in rank order in the reduce dtype, divide, upcast."""
        for i, p in enumerate(self.master.parameters()):
            gs = [g[i] for g in per_rank]
            if gs[0] is None:
                p.grad = None
                continue
            total = gs[0].to(self.rd).clone()
            for g in gs[1:]:
                total.add_(g.to(self.rd))
            p.grad = total.div_(self.world).to(torch.float32)

    def step(self, xs: list[Any], loss_of: Callable[[nn.Module, Any], torch.Tensor]
             ) -> list[torch.Tensor]:
        out = [self.rank_grads(x, loss_of) for x in xs]
        self.reduce([g for _, g in out])
        return [loss for loss, _ in out]

    def optimizer_step(self, set_to_none: bool) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=set_to_none)
        with torch.no_grad():
            for pc, pm in zip(self.compute.parameters(), self.master.parameters()):
                pc.copy_(pm)


def _mlps(reshard_after_forward: bool | int, pd: torch.dtype | None, rd: torch.dtype | None,
          world: int) -> tuple[nn.Module, Reference]:
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref = Reference(model, pd, rd, world)
    policy = sw.MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
    for m in [*model, model]:
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model, ref


def _train(rank: int, world: int, ex: Expect, model: nn.Module, ref: Reference,
           expect_rs_dtype: torch.dtype, iters: int = 5,
           make: Callable[[torch.Generator], Any] | None = None) -> None:
    make = make or randn(4, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for it in range(iters):
        xs = global_batch(it, world, make)
        with record() as log:
            loss = model(xs[rank]).sum()
            loss.backward()
        dtypes = {rec[3] for rec in log if rec[0] == "reduce_scatter"}
        ex.true(dtypes == {expect_rs_dtype}, f"iter {it}: reduce-scatter dtypes {dtypes}, "
                                             f"expected {expect_rs_dtype}")
        ex.close(loss, ref.step(xs, _sum)[rank], f"iter {it}: loss", check_dtype=False)
        check_sharded_parity(ex, ref.master, model, rank, world, f"iter {it}")
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 0))
        ref.optimizer_step(set_to_none=(it % 2 == 0))


def compute_dtype(rank: int, world: int, ex: Expect, param_dtype: str,
                  reshard_after_forward: bool | int) -> None:
    """Compute and reduce in bf16/fp16 (reduce_dtype unset), fp32 master weights."""
    pd = DTYPES[param_dtype]
    model, ref = _mlps(reshard_after_forward, pd, None, world)
    _train(rank, world, ex, model, ref, pd)


def reduce_dtype(rank: int, world: int, ex: Expect, param_dtype: str, reduce: str,
                 reshard_after_forward: bool | int) -> None:
    """bf16 compute with fp32 reduction, or fp32 compute with bf16 reduction."""
    pd, rd = DTYPES[param_dtype], DTYPES[reduce]
    model, ref = _mlps(reshard_after_forward, pd, rd, world)
    _train(rank, world, ex, model, ref, rd)


# reshard_after_forward=2 at 4 ranks, backward gathering within 2-rank blocks (hpz.py)
compute_dtype_hpz = in_blocks(compute_dtype, __name__)
reduce_dtype_hpz = in_blocks(reduce_dtype, __name__)


def reduce_dtype_after_frozen_first_forward(rank: int, world: int, ex: Expect) -> None:
    """Frozen (with an int64 parameter) for a no_grad forward, then unfrozen: gradients are
    reduced in fp32 and land in fp32."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
            self.non_float = nn.Parameter(torch.ones(16, dtype=torch.int64), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    model = Model()
    sw.fully_shard(model, mp_policy=sw.MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    model.requires_grad_(False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)
    model.layers.requires_grad_(True)
    with record() as log:
        model(x).sum().backward()
    dtypes = {rec[3] for rec in log if rec[0] == "reduce_scatter"}
    ex.true(dtypes == {torch.float32}, f"reduce-scatter dtypes {dtypes}")
    for n, p in model.layers.named_parameters():
        if ex.true(p.grad is not None or local_of(p).numel() == 0, f"{n} has no gradient") \
                and local_of(p).numel():
            ex.true(p.grad.dtype == torch.float32, f"{n} grad dtype {p.grad.dtype}")


def grad_acc_with_reduce_dtype(rank: int, world: int, ex: Expect,
                               reshard_after_forward: bool,
                               toggle_reshard_after_backward: bool = False) -> None:
    """Micro-batches without sync under bf16 compute / fp32 reduce: the unsharded gradients
    accumulate in fp32 (each micro-batch's bf16 gradient upcast, then summed).
    `toggle_reshard_after_backward`: as upstream's test is now, the full parameters are kept
    after each backward but the last unless reshard_after_forward."""
    pd, rd, microbatches = torch.bfloat16, torch.float32, 4
    model, ref = _mlps(reshard_after_forward, pd, rd, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for it in range(3):
        acc: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for mb in range(microbatches):
            last = mb == microbatches - 1
            model.set_requires_gradient_sync(last)
            if toggle_reshard_after_backward:
                model.set_reshard_after_backward(last or reshard_after_forward)
            xs = global_batch(10 * it + mb, world, randn(2, 16))
            with record() as log:
                loss = model(xs[rank]).sum()
                ex.true(loss.dtype == pd, f"loss dtype {loss.dtype}")
                loss.backward()
            ex.true({r[3] for r in log if r[0] == "reduce_scatter"} <= {rd}, "reduce dtype")
            for r, x in enumerate(xs):
                ref_loss, grads = ref.rank_grads(x, _sum)
                if r == rank:
                    ex.close(loss, ref_loss, f"iter {it} mb {mb}: loss")
                grads32 = [g.to(rd) for g in grads]
                acc[r] = grads32 if not acc[r] else [a + g for a, g in zip(acc[r], grads32)]
        ref.reduce(acc)
        check_sharded_parity(ex, ref.master, model, rank, world, f"iter {it}")
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 0))
        ref.optimizer_step(set_to_none=(it % 2 == 0))


# --- structured activations ---------------------------------------------------------------


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        if self.kind == "dataclass":
            return DC(x, x.clone())
        if self.kind == "nested_dataclass":
            return Outer(Inner(x, x.clone()), x.clone())
        return TensorPair(x, x.clone())


class ContainerModule(nn.Module):
    """One Linear applied to every tensor of the container."""

    def __init__(self, kind: str, dim: int) -> None:
        super().__init__()
        self.kind = kind
        self.layer = nn.Linear(dim, dim)

    def forward(self, inp: Any) -> Any:
        f = self.layer
        if self.kind == "dataclass":
            return DC(f(inp.x), f(inp.y))
        if self.kind == "nested_dataclass":
            return Outer(Inner(f(inp.inner.x), f(inp.inner.y)), f(inp.z))
        return TensorPair(f(inp.x), f(inp.y))


class FromContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, inp: Any) -> torch.Tensor:
        if self.kind == "nested_dataclass":
            return inp.inner.x + inp.inner.y + inp.z
        return inp.x + inp.y


def structured_input_output(rank: int, world: int, ex: Expect, container: str,
                            mp: str) -> None:
    """Dataclass, nested dataclass and NamedTuple activations between units, in fp32 and
    under mixed precision."""
    pd, rd = {"fp32": (None, None), "bf16": (torch.bfloat16, torch.bfloat16),
              "bf16_fp32_reduce": (torch.bfloat16, torch.float32)}[mp]
    torch.manual_seed(42)
    model = nn.Sequential(ToContainer(container), ContainerModule(container, 16),
                          ContainerModule(container, 16), FromContainer(container))
    ref = Reference(model, pd, rd, world)
    policy = sw.MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)
    for m in [*model, model]:
        sw.fully_shard(m, mp_policy=policy)
    _train(rank, world, ex, model, ref, rd or pd or torch.float32, iters=4,
           make=lambda g: torch.rand((2, 16), generator=g))
