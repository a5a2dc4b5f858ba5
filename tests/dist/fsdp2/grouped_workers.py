"""Scenarios of upstream test_fully_shard_training.py that use the list form of fully_shard
(one unit over several modules), left out of the first port: the memory-efficient module
groupings of test_train_parity_with_activation_checkpointing, the grouped [norm, head] (and
tied [embed, norm, head]) chunked loss of test_partial_group_forward_then_standalone,
grouped against ungrouped, test_partial_group_forward_grad_accum_chunked and
test_grouped_module_cast_forward_inputs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

import shardwise as sw
from shardwise.engine.core.dtensor import local_of
from shardwise.fsdp2 import fully_shard
from tests.dist.fsdp2.common import (
    DataParallelRef,
    Expect,
    check_sharded_parity,
    global_batch,
    tokens,
    train_parity,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.grad_acc_workers import raf_value
from tests.dist.fsdp2.models import ChunkedHeadModel, ModelArgs, Transformer, TransformerBlock
from tests.dist.fsdp2.training_compose_workers import WRAPPED


def ac_module_grouping(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                       checkpoint_impl: str, grouping: str) -> None:
    """mem_eff: layer 0 alone, layers 1-2 as one unit, both embeddings as one unit whose
    backward runs without gathering (set_unshard_in_backward(False)), [norm, output] as
    one; no weight tying. mem_eff_weight_tied: [tok_embeddings, output] (tied) as one unit,
    each layer alone."""
    torch.manual_seed(42)
    args = ModelArgs(n_layers=3, vocab_size=37, max_seq_len=16, dim=12, n_heads=3,
                     checkpoint_activations=checkpoint_impl == "utils",
                     weight_tying=grouping != "mem_eff")
    model = Transformer(args)
    ref = copy.deepcopy(model)
    prefixes: tuple[str, ...] = ()
    if checkpoint_impl == "wrapper":
        prefixes = (WRAPPED,)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    elif checkpoint_impl == "composable":
        for m in model.modules():
            if isinstance(m, TransformerBlock):
                checkpoint(m)
    kw = {"reshard_after_forward": reshard_after_forward}
    if grouping == "mem_eff":
        fully_shard(model.layers[0], **kw)
        fully_shard([model.layers[1], model.layers[2]], **kw)
        fully_shard([model.tok_embeddings, model.pos_embeddings], **kw)
        model.tok_embeddings.set_unshard_in_backward(False)
        fully_shard([model.norm, model.output], **kw)
    else:
        fully_shard([model.tok_embeddings, model.output], **kw)
        for layer in model.layers:
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    check_sharded_parity(ex, ref, model, rank, world, "before training", prefixes)
    train_parity(rank, world, ex, model, ref, tokens(37, 3, 16), _sum,
                 f"{grouping} {checkpoint_impl}", iters=4, prefixes=prefixes)


def _shard_chunked(m: ChunkedHeadModel, grouped: bool, tied: bool, kw: dict,
                   inner_mp: object = None, root_mp: object = None) -> None:
    if grouped and tied:
        fully_shard(m.body, mp_policy=root_mp, **kw)
        fully_shard([m.embed, m.norm, m.head], mp_policy=inner_mp, **kw)
    else:
        fully_shard(m.embed, mp_policy=root_mp, **kw)
        fully_shard(m.body, mp_policy=root_mp, **kw)
        if grouped:
            fully_shard([m.norm, m.head], mp_policy=inner_mp, **kw)
        else:
            fully_shard(m.norm, mp_policy=inner_mp, **kw)
            fully_shard(m.head, mp_policy=inner_mp, **kw)
    fully_shard(m, mp_policy=root_mp, **kw)


def _run_chunked(ex: Expect, m: nn.Module, toks: torch.Tensor, n_chunks: int, scale: float,
                 h_dtype: torch.dtype, what: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chunked loss; returns the loss and head.weight's local gradient after each chunk."""
    h = m(toks, skip_head=True)
    ex.true(h.dtype == h_dtype, f"{what}: hidden states dtype {h.dtype}, expected {h_dtype}")
    total = torch.zeros(())
    grads, snaps = [], []
    for chunk in torch.chunk(h.detach().float(), n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        out = m.head(chunk)
        ex.true(out.dtype == h_dtype, f"{what}: head output dtype {out.dtype}")
        loss = out.float().sum()
        total += loss.detach()
        (loss * scale).backward()
        grads.append(chunk.grad)
        g = m.head.weight.grad
        snaps.append(torch.zeros(0) if g is None else local_of(g.detach()).clone())
    h.backward(torch.cat(grads, dim=1).to(h.dtype))
    return total, snaps


def partial_group_forward_then_standalone(rank: int, world: int, ex: Expect, raf: str,
                                          weight_tying: bool, mp: str, ac: bool) -> None:
    """The root's forward skips the head, which then runs per chunk. The head is grouped with
    norm ([norm, head]; tied: [embed, norm, head]). Checked against the reference (fp32) and,
    untied, against the same model with norm and head as separate units: same losses,
    same head gradient after each chunk, same parameters after each step."""
    dim, vocab, n_chunks = 12, 23, 3
    bf16_out = sw.MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    inner_mp = root_mp = None
    if mp == "bf16_everywhere":
        inner_mp = root_mp = bf16_out
    elif mp == "bf16_inner_only":
        inner_mp, root_mp = bf16_out, sw.MixedPrecisionPolicy(param_dtype=torch.float32)
    h_dtype = torch.float32 if mp == "none" else torch.bfloat16
    kw = {"reshard_after_forward": raf_value(raf, world)}

    def new_model() -> ChunkedHeadModel:
        torch.manual_seed(42)
        m = ChunkedHeadModel(dim, vocab, weight_tying)
        if ac:
            checkpoint(m.body)
        return m

    ref = new_model()
    model = new_model()
    _shard_chunked(model, True, weight_tying, kw, inner_mp, root_mp)
    models = [model]
    if not weight_tying:
        ungrouped = new_model()
        _shard_chunked(ungrouped, False, False, kw, inner_mp, root_mp)
        models.append(ungrouped)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(3):
        xs = global_batch(it, world, tokens(vocab, 2, 9))
        results = [_run_chunked(ex, m, xs[rank], n_chunks, 1.0, h_dtype, f"iter {it}")
                   for m in models]
        loss, snaps = results[0]
        for i in range(1, len(snaps)):
            if snaps[i].numel():
                ex.true((snaps[i] - snaps[i - 1]).norm().item() > 0,
                        f"iter {it}: chunk {i} did not change head.weight.grad")
        if len(results) == 2:
            ex.close(results[1][0], loss, f"iter {it}: loss, ungrouped vs grouped")
            ex.close(results[1][1][-1], snaps[-1], f"iter {it}: head grad, ungrouped vs grouped")
            for (n, p), (_, q) in zip(model.named_parameters(), ungrouped.named_parameters()):
                ex.close(local_of(q.grad), local_of(p.grad),
                         f"iter {it}: grad {n}, ungrouped vs grouped")
        if mp == "none":
            ref_losses = [_run_chunked(ex, ref, x, n_chunks, 1 / world, torch.float32, "ref")[0]
                          for x in xs]
            ex.close(loss, ref_losses[rank], f"iter {it}: chunked loss")
            check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=(it % 2 == 0))
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=(it % 2 == 0))
        if len(models) == 2:
            for (n, p), (_, q) in zip(model.named_parameters(), ungrouped.named_parameters()):
                ex.close(local_of(q), local_of(p), f"iter {it}: param {n}, ungrouped vs grouped")


def partial_group_grad_accum_chunked(rank: int, world: int, ex: Expect,
                                     reshard_after_forward: bool, weight_tying: bool) -> None:
    """Chunked loss with gradient accumulation (set_requires_gradient_sync and
    set_is_last_backward): the grouped model's accumulated gradients equal the ungrouped
    model's (untied) and the reference's."""
    dim, vocab, n_chunks, microbatches = 12, 23, 2, 3
    kw = {"reshard_after_forward": reshard_after_forward}

    def setup(grouped: bool) -> ChunkedHeadModel:
        torch.manual_seed(42)
        m = ChunkedHeadModel(dim, vocab, weight_tying)
        _shard_chunked(m, grouped, weight_tying, kw)
        return m

    torch.manual_seed(42)
    ref = ChunkedHeadModel(dim, vocab, weight_tying)
    models = [setup(True)] + ([] if weight_tying else [setup(False)])
    dp = DataParallelRef(ref, world)
    for mb in range(microbatches):
        last = mb == microbatches - 1
        xs = global_batch(mb, world, tokens(vocab, 2, 8))
        for m in models:
            m.set_requires_gradient_sync(last)
            m.set_is_last_backward(last)
            _run_chunked(ex, m, xs[rank], n_chunks, 1.0, torch.float32, f"microbatch {mb}")

        def loss_of(r: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return r(x).sum()  # the chunked loss's gradients equal the plain loss's

        dp.step(xs, loss_of, sync=last)
    check_sharded_parity(ex, ref, models[0], rank, world, "grouped after accumulation",
                         rtol=1e-5, atol=1e-5)
    if len(models) == 2:
        for (n, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
            ex.close(local_of(q.grad), local_of(p.grad), f"grad {n}, ungrouped vs grouped")


def grouped_cast_forward_inputs(rank: int, world: int, ex: Expect) -> None:
    """cast_forward_inputs applies to each module of a grouped unit: an fp32 tensor between
    `a` and `b` of [a, b] is cast for `b` too; gradients match a bf16 reference."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(12, 12, bias=False)
            self.b = nn.Linear(12, 12, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).float())

    policy = sw.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(42)
    model = Model()
    fully_shard([model.a, model.b], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x = torch.randn(2, 12)
    out = model(x)
    ex.true(out.dtype == torch.bfloat16, f"output dtype {out.dtype}")
    out.sum().backward()
    for n, p in model.named_parameters():
        ex.true(p.grad is not None, f"grad of {n} is None")
        if p.grad is not None:
            ex.true(p.grad.dtype == torch.float32, f"grad of {n} is {p.grad.dtype}")


def multi_module_unused_module(rank: int, world: int, ex: Expect,
                               reshard_after_forward: bool) -> None:
    """Upstream test_fully_shard_comm.py's test_fully_shard_multi_module_unused_module: each
    of two blocks is one unit over [unused_lin, lin], and unused_lin never runs. Its
    gradients stay None (the optimizer skips it, as in the reference) and the rest trains
    as the reference does."""

    class ModuleWithUnusedLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused_lin = nn.Linear(1, 1)
            self.lin = nn.Linear(9, 9)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.relu(self.lin(x))

    torch.manual_seed(42)
    model = nn.Sequential(ModuleWithUnusedLinear(), ModuleWithUnusedLinear(), nn.Linear(9, 9))
    ref = copy.deepcopy(model)
    for block in model[:2]:
        fully_shard([block.unused_lin, block.lin], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    train_parity(rank, world, ex, model, ref, lambda g: torch.randn(3, 9, generator=g), _sum,
                 "unused module in a grouped unit", iters=3, optim=torch.optim.AdamW)
    for n, p in model.named_parameters():
        if "unused" in n:
            ex.true(p.grad is None, f"{n}.grad should stay None, got a gradient")
