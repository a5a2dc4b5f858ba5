"""Scenarios of upstream test_fully_shard_training.py: core training parity, parameter
registration, gradient accumulation, world size 1."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn

import shardwise as sw
from tests.dist.fsdp2.common import (
    DataParallelRef,
    Expect,
    check_sharded_parity,
    count,
    full_params_match,
    global_batch,
    is_sharded,
    randn,
    record_collectives,
    ref_step,
    sharded_modules,
    tokens,
    train_parity,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.models import MLP, ModelArgs, Transformer, transformer_blocks


def root_move_forward_input_to_device(rank: int, world: int, ex: Expect) -> None:
    class ParamlessModule(nn.Module):
        def forward(self, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return x + ys[0] + ys[1] + 1

    model = sw.fully_shard(ParamlessModule())
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    ex.close(model(x, ys), x + ys[0] + ys[1] + 1, "paramless root output")


def root_no_forward_inputs(rank: int, world: int, ex: Expect) -> None:
    class ParameterOnlyModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 5))

        def forward(self) -> torch.Tensor:
            return self.weight @ self.weight

    torch.manual_seed(0)
    model = ParameterOnlyModule()
    ref = copy.deepcopy(model)
    sw.fully_shard(model)
    out = model()
    ex.true(out.shape == (5, 5), f"output shape {tuple(out.shape)}")
    out.sum().backward()
    ref().sum().backward()
    check_sharded_parity(ex, ref, model, rank, world, "no forward inputs")


def _registration_check(ex: Expect, model: nn.Module, ref: nn.Module, rank: int, world: int,
                        expect_sharded: dict[str, bool], what: str) -> None:
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        rp = named[name]
        sharded = is_sharded(p, rp.shape, rank, world)
        if ex.true(sharded == expect_sharded[name],
                   f"{what}: {name} is {'sharded' if sharded else 'unsharded'}, expected "
                   f"{'sharded' if expect_sharded[name] else 'unsharded'}") and not sharded:
            ex.close(p.detach(), rp.detach(), f"{what}: unsharded {name} value")
    full_params_match(ex, model, ref, what)


def param_registration_after_forward(rank: int, world: int, ex: Expect,
                                     reshard_after_forward: bool | None) -> None:
    """Units follow reshard_after_forward; with None (FSDP2's default) the root keeps its
    parameters after a forward, an explicit True reshards it too (torch 2.13's FSDP2);
    reshard() shards them by hand."""
    raf = reshard_after_forward
    for multi in (False, True):
        torch.manual_seed(42)
        model = nn.Sequential(MLP(3), MLP(3)) if multi else MLP(3)
        ref = copy.deepcopy(model)
        if multi:
            sw.fully_shard(model[0].in_proj, reshard_after_forward=raf)
            sw.fully_shard(model[0].out_proj, reshard_after_forward=raf)
        sw.fully_shard(model, reshard_after_forward=raf)
        what = f"{'multi' if multi else 'single'} unit"
        names = [n for n, _ in model.named_parameters()]
        _registration_check(ex, model, ref, rank, world, dict.fromkeys(names, True),
                            f"{what}, before forward")
        model(torch.randn(2, 3))
        # Sharded after forward: everything with an explicit True; with None, the
        # non-root units (model[0]'s projections); nothing with False.
        after = {n: bool(raf) or (raf is None and n.startswith("0.")) for n in names}
        _registration_check(ex, model, ref, rank, world, after, f"{what}, after forward")
        for m in sharded_modules(model):
            m.reshard()
        _registration_check(ex, model, ref, rank, world, dict.fromkeys(names, True),
                            f"{what}, after reshard()")


def param_registration_after_backward(rank: int, world: int, ex: Expect,
                                      reshard_after_forward: bool) -> None:
    for multi in (False, True):
        model = MLP(8)
        if multi:
            sw.fully_shard(model.in_proj, reshard_after_forward=reshard_after_forward)
            sw.fully_shard(model.out_proj, reshard_after_forward=reshard_after_forward)
        sw.fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref = MLP(8)
        ref.load_state_dict(sw.full_state_dict(model))
        model(torch.randn(2, 8)).sum().backward()
        _registration_check(ex, model, ref, rank, world,
                            {n: True for n, _ in model.named_parameters()},
                            f"{'multi' if multi else 'single'} unit, after backward")


def to_float64_after_init(rank: int, world: int, ex: Expect) -> None:
    """model.to(float64) after sharding: trains in float64 with parity, or is refused at the
    call (issue 12, defect 14: it must not fail later)."""
    torch.manual_seed(42)
    model = MLP(4)
    ref = copy.deepcopy(model).to(torch.float64)
    for m in (model.in_proj, model.out_proj, model):
        sw.fully_shard(m)
    try:
        model.to(torch.float64)
    except (ValueError, RuntimeError, TypeError):
        return  # refused at the call: allowed
    for n, p in model.named_parameters():
        ex.true(p.dtype == torch.float64, f"param {n} dtype {p.dtype} after .to(float64)")
    train_parity(rank, world, ex, model, ref, lambda g: torch.randn(2, 4, generator=g,
                                                                    dtype=torch.float64),
                 _sum, "float64", iters=4)
    for n, p in model.named_parameters():
        if p.grad is not None:
            ex.true(p.grad.dtype == torch.float64, f"grad {n} dtype {p.grad.dtype}")


def train_parity_single_group(rank: int, world: int, ex: Expect) -> None:
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))
        ref = copy.deepcopy(model)
        sw.fully_shard(model)
        train_parity(rank, world, ex, model, ref, randn(4, shapes[0][0]), _sum,
                     f"shapes {shapes}", check_each=False)


def train_parity_single_worldsize1(rank: int, world: int, ex: Expect) -> None:
    """One rank: same numbers as unsharded training, and no collective at all."""
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))
        ref = copy.deepcopy(model)
        sw.fully_shard(model)
        with record_collectives() as log:
            train_parity(rank, world, ex, model, ref, randn(4, shapes[0][0]), _sum,
                         f"shapes {shapes}", check_each=False)
        ex.true(not log, f"collectives at world size 1: {log[:4]}")


def train_parity_multi_group(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                             offload: bool) -> None:
    torch.manual_seed(42)
    args = ModelArgs(n_layers=3, vocab_size=37, max_seq_len=16, dim=12, n_heads=3)
    model = Transformer(args)
    ref = copy.deepcopy(model)
    policy = sw.CPUOffloadPolicy(pin_memory=False) if offload else None
    for m in [*transformer_blocks(model), model]:
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    train_parity(rank, world, ex, model, ref, tokens(37, 3, 16), _sum, "transformer",
                 check_each=False)


def non_root_forward_backward(rank: int, world: int, ex: Expect) -> None:
    """A step through the root, then a step through one non-root unit alone."""
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(9) for _ in range(3)])
    ref = copy.deepcopy(model)
    for m in [*model, model]:
        sw.fully_shard(m)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    xs = global_batch(7, world, randn(4, 9))
    for what, pick in (("root", lambda m: m), ("non-root", lambda m: m[0])):
        loss = pick(model)(xs[rank]).sum()
        loss.backward()
        ref_losses = ref_step(ref, xs, lambda m, x, p=pick: p(m)(x).sum())
        ex.close(loss, ref_losses[rank], f"{what} loss")
        check_sharded_parity(ex, ref, model, rank, world, f"after {what} backward")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ex.close(model(xs[rank]).sum(), ref(xs[rank]).sum(), "loss after both steps")


def multi_forward_module(rank: int, world: int, ex: Expect, reshard_after_forward: bool) -> None:
    class MultiForwardModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.outer = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(self.inner(x) + self.inner(x))

    torch.manual_seed(42)
    model = MultiForwardModule()
    ref = copy.deepcopy(model)
    sw.fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
    sw.fully_shard(model, reshard_after_forward=reshard_after_forward)
    train_parity(rank, world, ex, model, ref, randn(8, 4), _sum, "inner used twice")


def layer_by_layer_shard(rank: int, world: int, ex: Expect) -> None:
    """Blocks sharded one at a time as they are built (gc in between), then the root."""

    class SimpleBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(6)
            self.linear = nn.Linear(6, 6, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.norm(x))

    class LayerByLayerModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(3)
    model, ref = LayerByLayerModel(), LayerByLayerModel()
    for _ in range(8):
        block = SimpleBlock()
        ref.blocks.append(copy.deepcopy(block))
        model.blocks.append(block)
        sw.fully_shard(block)
        gc.collect()
    sw.fully_shard(model)
    train_parity(rank, world, ex, model, ref, randn(2, 4, 6), _sum, "layer by layer", iters=2)


def gradient_accumulation(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                          mode: str, offload: bool) -> None:
    """Micro-batches without reduce-scatter (all units / the root only / some MLPs), the
    collectives each iteration issues, and parity with the reference; zero_grad alternates
    set_to_none, which mixes accumulation with and without communication."""
    torch.manual_seed(42)
    num_mlps, microbatches, dim = 3, 3, 9
    model = nn.Sequential(nn.Linear(dim, dim), *[MLP(dim) for _ in range(num_mlps)])
    ref = copy.deepcopy(model)
    policy = sw.CPUOffloadPolicy(pin_memory=False) if offload else None
    for m in [*model[1:], model]:
        # Each unit alone: the collectives per iteration are FSDP2's, counted below ([Note:
        # coalesced units] in engine/core/schedule.py; coalesced, the numbers are the same).
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward, offload_policy=policy,
                       coalesce_bytes=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp = DataParallelRef(ref, world)
    no_sync_prefixes = {"all": ("",), "some_mlps": ("1.", "2."), "root_only": ("0.",)}[mode]

    def set_sync(last: bool) -> None:
        if mode == "all":
            model.set_requires_gradient_sync(last)
        elif mode == "some_mlps":
            for mlp in model[1:3]:
                mlp.set_requires_gradient_sync(last)
        else:
            model.set_requires_gradient_sync(last, recurse=False)

    for it in range(3):
        with record_collectives() as log:
            for mb in range(microbatches):
                set_sync(mb == microbatches - 1)
                xs = global_batch(10 * it + mb, world, randn(2, dim))
                loss = model(xs[rank]).sum()
                loss.backward()
                last = mb == microbatches - 1
                ref_losses = dp.step(xs, _sum, lambda n, last=last: last or not n.startswith(
                    no_sync_prefixes))
                ex.close(loss, ref_losses[rank], f"iter {it} mb {mb}: loss")
        rs = num_mlps + 1
        if mode == "some_mlps":
            rs += (num_mlps - 2 + 1) * (microbatches - 1)
        elif mode == "root_only":
            rs += num_mlps * (microbatches - 1)
        # An explicit reshard_after_forward=True reshards the root too (torch 2.13's FSDP2),
        # so a backward gathers every unit again, as upstream's count says.
        ag = (num_mlps + 1 + (num_mlps + 1 if reshard_after_forward else 0)) * microbatches
        ex.true(count(log, "reduce_scatter") == rs,
                f"iter {it}: {count(log, 'reduce_scatter')} reduce-scatters, expected {rs}")
        ex.true(count(log, "all_gather") == ag,
                f"iter {it}: {count(log, 'all_gather')} all-gathers, expected {ag}")
        ex.true(count(log, "all_reduce") == 0, f"iter {it}: unexpected all-reduces")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


def microbatching_1f1b(rank: int, world: int, ex: Expect, explicit_unshard: bool) -> None:
    """Pipeline-style micro-batches with reshard_after_forward=False, reducing only on the
    last one; optionally every unit is unsharded up front (synchronously: shardwise's
    unshard() has no async handle)."""
    torch.manual_seed(42)
    args = ModelArgs(vocab_size=23, max_seq_len=16)
    model = Transformer(args)
    ref = copy.deepcopy(model)
    for m in [*transformer_blocks(model), model]:
        sw.fully_shard(m, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp = DataParallelRef(ref, world)
    if explicit_unshard:
        for m in sharded_modules(model):
            m.unshard()
    for mb in range(3):
        model.set_requires_gradient_sync(mb == 2)
        xs = global_batch(mb, world, tokens(23, 2, 16))
        loss = model(xs[rank]).sum()
        loss.backward()
        ex.close(loss, dp.step(xs, _sum, sync=mb == 2)[rank], f"microbatch {mb}: loss")
    check_sharded_parity(ex, ref, model, rank, world, "after 3 micro-batches")
    opt.step()
    ref_opt.step()
    check_sharded_parity(ex, ref, model, rank, world, "after the step")
