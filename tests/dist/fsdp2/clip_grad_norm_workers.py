"""Scenario of upstream test_fully_shard_clip_grad_norm_.py, through sw.clip_grad_norm_."""

from __future__ import annotations

import copy

import torch

import shardwise as sw
from tests.dist.fsdp2.common import (
    Expect,
    check_sharded_parity,
    count,
    global_batch,
    record_collectives,
    ref_step,
    tokens,
)
from tests.dist.fsdp2.models import ModelArgs, Transformer, transformer_blocks


def clip_grad_norm_1d(rank: int, world: int, ex: Expect, norm_type: float) -> None:
    """The total norm equals torch.nn.utils.clip_grad_norm_ on the unsharded model, with one
    all-reduce; the clipped gradients match the reference's, every one changed."""
    max_norm = 1.0
    torch.manual_seed(42)
    model = Transformer(ModelArgs())
    ref = copy.deepcopy(model)
    for m in [*transformer_blocks(model), model]:
        sw.fully_shard(m)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    vocab = model.model_args.vocab_size
    for it in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        xs = global_batch(it, world, tokens(vocab, 3, 13))
        model(xs[rank]).sum().backward()
        ref_step(ref, xs, lambda m, x: m(x).sum())
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it} before clipping")
        before = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                  if p.grad is not None}
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=max_norm,
                                                   norm_type=norm_type)
        ex.true(ref_total.item() > max_norm, f"iter {it}: clipping would be vacuous "
                                             f"(norm {ref_total.item()})")
        with record_collectives() as log:
            total = sw.clip_grad_norm_(model, max_norm=max_norm, norm_type=norm_type)
        ex.close(total, ref_total, f"iter {it}: total norm", rtol=1e-5, atol=1e-5)
        if world > 1:
            ex.true(count(log, "all_reduce") == 1 and len(log) == 1,
                    f"iter {it}: collectives {[r[:2] for r in log]}")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it} after clipping")
        after = dict(model.named_parameters())
        for n, g in before.items():
            if torch.count_nonzero(g):
                ex.true(not torch.equal(after[n].grad, g), f"iter {it}: grad {n} unchanged "
                                                           "by clipping")
        opt.step()
        ref_opt.step()
