"""Scenarios of upstream test_fully_shard_training.py (TestFullyShard1DTrainingCompose,
TestFullyShardSharedParams): activation checkpointing, partial forwards with a chunked
head, several forwards per backward, tied parameters."""

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
from tests.dist.fsdp2.common import (
    Expect,
    check_sharded_parity,
    global_batch,
    ref_step,
    tokens,
    train_parity,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.models import ChunkedHeadModel, ModelArgs, Transformer, TransformerBlock

WRAPPED = "_checkpoint_wrapped_module."




def _small_transformer(**kw: object) -> Transformer:
    torch.manual_seed(42)
    return Transformer(ModelArgs(n_layers=3, vocab_size=37, max_seq_len=16, dim=12, n_heads=3,
                                 **kw))  # type: ignore[arg-type]


def activation_checkpointing(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                             checkpoint_impl: str) -> None:
    model = _small_transformer(checkpoint_activations=checkpoint_impl == "utils")
    ref = copy.deepcopy(model)
    if checkpoint_impl == "wrapper":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    elif checkpoint_impl == "composable":
        for layer in model.layers:
            checkpoint(layer)
    for m in [*model.layers, model]:
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward)
    check_sharded_parity(ex, ref, model, rank, world, "before training", (WRAPPED,))
    train_parity(rank, world, ex, model, ref, tokens(37, 3, 16), _sum,
                 f"AC {checkpoint_impl}", iters=4, prefixes=(WRAPPED,))


def _chunk_step(ex: Expect, m: nn.Module, toks: torch.Tensor, scale: float, n_chunks: int,
                h_dtype: torch.dtype, what: str, snapshots: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
    """Hidden states from the model, then the head chunk by chunk (one backward each), then
    the hidden states' backward with the chunks' input gradients: a chunked loss."""
    h = m(toks, skip_head=True)
    ex.true(h.dtype == h_dtype, f"{what}: hidden states dtype {h.dtype}, expected {h_dtype}")
    total = torch.zeros(())
    h_grads = []
    for chunk in torch.chunk(h.detach().float(), n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        out = m.head(chunk)
        ex.true(out.dtype == h_dtype, f"{what}: head output dtype {out.dtype}, expected {h_dtype}")
        loss = out.float().sum()
        total += loss.detach()
        (loss * scale).backward()
        h_grads.append(chunk.grad)
        if snapshots is not None:
            g = m.head.weight.grad
            snapshots.append(torch.zeros(0) if g is None else local_of(g.detach()).clone())
    h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
    return total


def partial_forward_then_standalone(rank: int, world: int, ex: Expect,
                                    reshard_after_forward: bool, mp: str, ac: bool) -> None:
    """The model's forward skips the head (a unit); the head then runs alone per chunk.

    mp='none' is compared with the reference. The bf16 modes check the dtypes that each
    unit's own output_dtype gives (on every unit, or on the inner units only)."""
    dim, vocab, n_chunks = 12, 23, 4
    bf16_out = sw.MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    inner_mp = root_mp = None
    if mp == "bf16_everywhere":
        inner_mp = root_mp = bf16_out
    elif mp == "bf16_inner_only":
        inner_mp, root_mp = bf16_out, sw.MixedPrecisionPolicy(param_dtype=torch.float32)
    h_dtype = torch.float32 if mp == "none" else torch.bfloat16
    torch.manual_seed(42)
    model = ChunkedHeadModel(dim, vocab, tie=False)
    ref = copy.deepcopy(model)
    if ac:
        checkpoint(model.body)
    kw = {"reshard_after_forward": reshard_after_forward}
    for m, pol in ((model.embed, root_mp), (model.body, root_mp), (model.norm, inner_mp),
                   (model.head, inner_mp), (model, root_mp)):
        sw.fully_shard(m, mp_policy=pol, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(3 if mp == "none" else 2):
        xs = global_batch(it, world, tokens(vocab, 2, 16))
        snaps: list[torch.Tensor] = []
        loss = _chunk_step(ex, model, xs[rank], 1.0, n_chunks, h_dtype, f"iter {it}", snaps)
        for i in range(1, len(snaps)):
            if snaps[i].numel() and snaps[i].shape == snaps[i - 1].shape:
                ex.true((snaps[i] - snaps[i - 1]).norm().item() > 0,
                        f"iter {it}: chunk {i} did not change head.weight.grad")
            elif snaps[i].numel() or snaps[i - 1].numel():
                ex.true(False, f"iter {it}: head.weight.grad missing around chunk {i}")
        if mp == "none":
            ref_losses = [_chunk_step(ex, ref, x, 1 / world, n_chunks, torch.float32, "ref")
                          for x in xs]
            ex.close(loss, ref_losses[rank], f"iter {it}: chunked loss")
            check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=(it % 2 == 0))


def cast_forward_inputs_each_unit(rank: int, world: int, ex: Expect) -> None:
    """An fp32 tensor between two bf16 units: the second unit casts its own input."""

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
    for m in (model.a, model.b, model):
        sw.fully_shard(m, mp_policy=policy)
    out = model(torch.randn(2, 12))
    ex.true(out.dtype == torch.bfloat16, f"output dtype {out.dtype}")
    out.sum().backward()
    for n, p in model.named_parameters():
        ex.true(p.grad is not None, f"grad of {n} is None")


def partial_forward_grad_accum_chunked(rank: int, world: int, ex: Expect,
                                       reshard_after_forward: bool) -> None:
    """Chunked loss + gradient accumulation: no sync on the first micro-batches."""
    torch.manual_seed(42)
    model = ChunkedHeadModel(12, 23, tie=False)
    ref = copy.deepcopy(model)
    for m in (model.embed, model.body, model.norm, model.head, model):
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward)
    for mb in range(3):
        model.set_requires_gradient_sync(mb == 2)
        xs = global_batch(mb, world, tokens(23, 2, 16))
        loss = _chunk_step(ex, model, xs[rank], 1.0, 2, torch.float32, f"microbatch {mb}")
        ref_losses = [_chunk_step(ex, ref, x, 1 / world, 2, torch.float32, "ref") for x in xs]
        ex.close(loss, ref_losses[rank], f"microbatch {mb}: loss")
    check_sharded_parity(ex, ref, model, rank, world, "after accumulation")


def double_forward_nested_checkpoint(rank: int, world: int, ex: Expect,
                                     reshard_after_forward: bool, checkpoint_impl: str) -> None:
    """Two forwards, one backward of a loss of both (the DPO pattern), nested units, AC."""
    model = _small_transformer(checkpoint_activations=checkpoint_impl == "utils")
    ref = copy.deepcopy(model)
    if checkpoint_impl == "composable":
        for layer in model.layers:
            checkpoint(layer)
    kw = {"reshard_after_forward": reshard_after_forward}
    for layer in model.layers:
        sw.fully_shard(layer.attention, **kw)
        sw.fully_shard(layer.feed_forward, **kw)
        sw.fully_shard(layer, **kw)
    sw.fully_shard(model, **kw)
    xs = global_batch(5, world, lambda g: torch.randint(0, 37, (2, 2, 16), generator=g))

    def dpo(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out1, out2 = m(x[0]), m(x[1])
        return (out1.sum() - out2.sum()).pow(2) / 1000

    loss = dpo(model, xs[rank])
    loss.backward()
    ex.close(loss, ref_step(ref, xs, dpo)[rank], "loss", rtol=1e-5)
    for n, p in model.named_parameters():
        ex.true(p.grad is not None or local_of(p).numel() == 0, f"grad of {n} is None")
    check_sharded_parity(ex, ref, model, rank, world, "after the backward", rtol=1e-5)


def double_partial_forward_then_backward(rank: int, world: int, ex: Expect) -> None:
    """Two forwards that skip the head unit, one backward: the head gets no gradient."""
    torch.manual_seed(42)
    model = ChunkedHeadModel(12, 23, tie=False)
    ref = copy.deepcopy(model)
    for m in (model.norm, model.head, model):
        sw.fully_shard(m)
    xs = global_batch(9, world, lambda g: torch.randint(0, 23, (2, 2, 16), generator=g))

    def loss_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x[0], skip_head=True).sum() + m(x[1], skip_head=True).sum()

    loss = loss_of(model, xs[rank])
    loss.backward()
    ex.close(loss, ref_step(ref, xs, loss_of)[rank], "loss")
    ex.true(model.head.weight.grad is None, "head.weight.grad should be None (head unused)")
    for n, p in model.named_parameters():
        if n != "head.weight" and p.grad is not None:
            ex.true(torch.isfinite(p.grad).all().item(), f"non-finite grad for {n}")
    check_sharded_parity(ex, ref, model, rank, world, "after the backward")


def shared_params(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                  activation_checkpointing: bool) -> None:
    model = _small_transformer(weight_tying=True)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        if activation_checkpointing:
            checkpoint(layer)
        sw.fully_shard(layer, reshard_after_forward=reshard_after_forward)
    sw.fully_shard(model, reshard_after_forward=reshard_after_forward)
    train_parity(rank, world, ex, model, ref, tokens(37, 2, 16), _sum, "tied embedding",
                 iters=4)


def shared_params_uneven_shard(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                               units: str) -> None:
    """A tied embedding/output whose vocab does not divide by the world size: every row,
    the last rank's padded ones included, trains. units='separate' shards the two tied
    modules by separate calls (shardwise moves the tied weight to the common parent)."""
    vocab, hidden = world * 4 + 1, 6

    class TiedModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, hidden)
            self.output = nn.Linear(hidden, vocab, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.output(self.tok_embeddings(ids))

    torch.manual_seed(42)
    model = TiedModel()
    ref = copy.deepcopy(model)
    kw = {"reshard_after_forward": reshard_after_forward}
    if units == "separate":
        sw.fully_shard(model.tok_embeddings, **kw)
        sw.fully_shard(model.output, **kw)
    sw.fully_shard(model, **kw)
    initial = sw.full_state_dict(model)["tok_embeddings.weight"]

    def ce(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(ids).view(-1, vocab).float(), ids.view(-1))

    train_parity(rank, world, ex, model, ref, tokens(vocab, 2, 8), ce, "tied", iters=8,
                 check_each=False, optim=torch.optim.AdamW)
    final = sw.full_state_dict(model)["tok_embeddings.weight"]
    for row in range(vocab):
        ex.true(not torch.equal(initial[row], final[row]), f"row {row} was not updated")
