"""Scenarios of upstream test_fully_shard_comm.py: how many all-gathers and reduce-scatters
a step issues, their order in backward (prefetch), manual reshard/unshard, world size 1."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.engine.core.dtensor import local_of
from tests.dist.fsdp2.common import (
    Expect,
    count,
    record_collectives,
    shard_rows,
    sharded_modules,
)
from tests.dist.fsdp2.hpz import Gather, K, record_gathers
from tests.dist.fsdp2.models import MLP, ModelArgs, Transformer, transformer_blocks


def _fully_shard(*args: Any, **kwargs: Any) -> Any:
    """sw.fully_shard with each unit alone: these scenarios count FSDP2's collectives
    per unit ([Note: coalesced units] in engine/core/schedule.py)."""
    return sw.fully_shard(*args, coalesce_bytes=0, **kwargs)


def _transformer(n_layers: int = 2, checkpoint_impl: str | None = None,
                 reshard_after_forward: bool | int | None = True
                 ) -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(42)
    args = ModelArgs(n_layers=n_layers, checkpoint_activations=checkpoint_impl == "utils")
    model = Transformer(args)
    for block in transformer_blocks(model):
        if checkpoint_impl == "composable":
            checkpoint(block)
        _fully_shard(block, reshard_after_forward=reshard_after_forward)
    _fully_shard(model, reshard_after_forward=reshard_after_forward)
    g = torch.Generator().manual_seed(7)
    return model, torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=g)


def _groups(ex: Expect, log: list[Gather], size: int, what: str) -> None:
    """Every all-gather in `log` ran over `size` ranks (hpZ: forward over the shard group,
    backward within the K-rank blocks)."""
    got = [(g.label, g.group) for g in log if g.group != size]
    ex.true(not got, f"{what}: all-gathers over other than {size} ranks: {got}")


def communication_count(rank: int, world: int, ex: Expect,
                        reshard_after_forward: bool | int | None) -> None:
    """Forward: one all-gather per unit. Backward: one reduce-scatter per unit, and an
    all-gather per resharded unit: with None (FSDP2's default) the root keeps its
    parameters; an explicit True reshards the root too, as torch 2.13's FSDP2 does. An
    int (hpZ) reshards every unit as True does, and backward gathers within K-rank blocks."""
    hpz = type(reshard_after_forward) is int
    model, inp = _transformer(reshard_after_forward=reshard_after_forward)
    blocks = len(transformer_blocks(model))
    for it in range(2):
        with record_collectives() as fwd, record_gathers() as fwd_groups:
            loss = model(inp)
        ex.true([r[0] for r in fwd] == ["all_gather"] * (blocks + 1),
                f"iter {it}: forward issued {[r[:2] for r in fwd]}")
        with record_collectives() as bwd, record_gathers() as bwd_groups:
            loss.sum().backward()
        if hpz:
            _groups(ex, fwd_groups, world, f"iter {it} forward")
            _groups(ex, bwd_groups, K, f"iter {it} backward")
        ag = blocks + 1 if hpz else {None: blocks, True: blocks + 1,
                                     False: 0}[reshard_after_forward]
        ex.true(count(bwd, "all_gather") == ag,
                f"iter {it}: backward all-gathers {count(bwd, 'all_gather')}, expected {ag}")
        ex.true(count(bwd, "reduce_scatter") == blocks + 1,
                f"iter {it}: backward reduce-scatters {count(bwd, 'reduce_scatter')}, "
                f"expected {blocks + 1}")
        ex.true(count(bwd, "all_reduce") == 0, f"iter {it}: backward all-reduced")


def manual_reshard_with_reshard_after_forward_false(rank: int, world: int, ex: Expect) -> None:
    """reshard() by hand after a forward that kept parameters: backward gathers again."""
    model, inp = _transformer(reshard_after_forward=False)
    units = len(sharded_modules(model))
    with record_collectives() as fwd:
        loss = model(inp)
    ex.true(count(fwd, "all_gather") == units and len(fwd) == units,
            f"forward issued {[r[:2] for r in fwd]}")
    for m in sharded_modules(model):
        m.reshard()
    with record_collectives() as bwd:
        loss.sum().backward()
    ex.true(count(bwd, "all_gather") == units,
            f"backward all-gathers {count(bwd, 'all_gather')}, expected {units}")
    ex.true(count(bwd, "reduce_scatter") == units,
            f"backward reduce-scatters {count(bwd, 'reduce_scatter')}, expected {units}")


def backward_prefetch(rank: int, world: int, ex: Expect,
                      reshard_after_forward: bool | int | None, checkpoint_impl: str) -> None:
    """In backward, the previous block's all-gather is issued before the current block's
    reduce-scatter (upstream's expected event order); activation checkpointing changes
    nothing about it. An explicit reshard_after_forward resharded the root too: it
    gathers first. An int (hpZ) gives True's order, every backward gather within a block."""
    hpz = type(reshard_after_forward) is int
    impl = None if checkpoint_impl == "none" else checkpoint_impl
    model, inp = _transformer(3, impl, reshard_after_forward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ag, rs = "all_gather", "reduce_scatter"
    expected = [(ag, "layers.2"), (ag, "layers.1"), (rs, "layers.2"), (ag, "layers.0"),
                (rs, "layers.1"), (rs, "layers.0"), (rs, "<root>")]
    if reshard_after_forward is True or hpz:
        expected.insert(0, (ag, "<root>"))
    if reshard_after_forward is False:
        expected = [e for e in expected if e[0] != ag]
    for it in range(3):
        loss = model(inp)
        with record_collectives() as log, record_gathers() as groups:
            loss.sum().backward()
        got = [(op, label) for op, label, _, _ in log]
        ex.true(got == expected, f"iter {it}: backward order {got}, expected {expected}")
        if hpz:
            _groups(ex, groups, K, f"iter {it} backward")
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 0))


def backward_prefetch_multi_forward(rank: int, world: int, ex: Expect,
                                    reshard_after_forward: bool | int,
                                    checkpoint_impl: str) -> None:
    """Upstream's two forwards before one backward, by numbers (its event list counts
    FSDP2's no-op unshard calls): gradients equal the unsharded model's, the second
    forward gathered every unit again, and under hpZ backward gathered within blocks
    where a unit still held its block rows (the first backward through it)."""
    impl = None if checkpoint_impl == "none" else checkpoint_impl
    torch.manual_seed(42)
    ref = Transformer(ModelArgs(n_layers=3, checkpoint_activations=impl == "utils"))
    model, inp = _transformer(3, impl, reshard_after_forward)
    ref.load_state_dict(sw.full_state_dict(model))
    units = len(sharded_modules(model))
    with record_collectives() as fwd:
        loss1, loss2 = model(inp), model(inp)
    ex.true(count(fwd, "all_gather") == 2 * units,
            f"two forwards all-gathered {count(fwd, 'all_gather')} times, expected {2 * units}")
    with record_gathers() as bwd:
        (loss1 + loss2).sum().backward()
    (ref(inp) + ref(inp)).sum().backward()
    named = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        ex.close(local_of(p.grad), shard_rows(named[n].grad, rank, world), f"grad {n}",
                 rtol=1e-5, atol=1e-5)
    if type(reshard_after_forward) is int:
        sizes = sorted({g.group for g in bwd})
        ex.true(sizes == [K, world], f"backward all-gathers over {sizes} ranks: expected "
                                     f"[{K}, {world}] (blocks first, then full regathers)")


def unshard_no_param_group(rank: int, world: int, ex: Expect) -> None:
    """unshard()/reshard() on a unit that owns no parameters is a no-op."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for m in [*model, model]:
        _fully_shard(m)
    model.unshard()
    model.reshard()
    out = model(torch.randn(2, 4))
    out.sum().backward()
    ex.true(all(p.grad is not None for p in model.parameters()), "missing gradients")


def unshard_without_lazy_init(rank: int, world: int, ex: Expect) -> None:
    """unshard() before any forward registers the full parameters."""
    torch.manual_seed(42)
    model = MLP(4)
    ref = copy.deepcopy(model)
    _fully_shard(model)
    model.unshard()
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        ex.close(p.detach(), rp.detach(), f"{n} after unshard()")
    model.reshard()
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        ex.close(local_of(p.detach()), shard_rows(rp.detach(), rank, world), f"{n} after reshard()")


def singleton_no_division(rank: int, world: int, ex: Expect) -> None:
    """One rank: the gradient is not divided (the mean over one rank is itself)."""
    model = nn.Linear(8, 4, bias=False)
    _fully_shard(model)
    model(torch.ones(3, 8)).sum().backward()
    # A one-rank mesh still gives DTensor parameters and gradients, as FSDP2's does.
    ex.true(isinstance(model.weight.grad, DTensor), "one rank: the gradient is a DTensor")
    ex.close(local_of(model.weight.grad), torch.full((4, 8), 3.0), "weight grad")


def size1_reduceop(rank: int, world: int, ex: Expect) -> None:
    torch.manual_seed(42)
    model = nn.Linear(64, 65)
    ref = copy.deepcopy(model)
    _fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.Adam(model.parameters())
    ref_opt = torch.optim.Adam(ref.parameters())
    inp = torch.randn(65, 64)
    for it in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss = m(inp).sum()
            loss.backward()
            o.step()
            if m is ref:
                ref_loss = loss
        ex.close(loss, ref_loss, f"iter {it}: loss")
        ex.close(local_of(model.bias.grad), ref.bias.grad, f"iter {it}: bias grad")


def set_reshard_after_forward_counts(rank: int, world: int, ex: Expect,
                                     set_reshard_after_forward: bool | None,
                                     recurse: bool) -> None:
    """Upstream's test_set_reshard_after_forward: built with the opposite value, then set
    at run time (on the root only with recurse=False); the backward all-gathers follow."""
    raf = None if set_reshard_after_forward is None else not set_reshard_after_forward
    model, inp = _transformer(reshard_after_forward=raf)
    blocks = len(transformer_blocks(model))
    if set_reshard_after_forward is not None:
        model.set_reshard_after_forward(set_reshard_after_forward, recurse=recurse)
    with record_collectives() as fwd:
        loss = model(inp)
    ex.true(count(fwd, "all_gather") == blocks + 1, f"forward issued {fwd}")
    with record_collectives() as bwd:
        loss.sum().backward()
    if set_reshard_after_forward is None:
        ag = blocks
    elif set_reshard_after_forward:
        ag = blocks + 1 if recurse else 1
    else:
        ag = 0 if recurse else blocks
    ex.true(count(bwd, "all_gather") == ag,
            f"backward all-gathers {count(bwd, 'all_gather')}, expected {ag}")
    ex.true(count(bwd, "reduce_scatter") == blocks + 1, "one reduce-scatter per unit")
