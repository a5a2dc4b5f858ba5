"""Scenarios of upstream test_fully_shard_training.py that drive FSDP2's module methods
during training: explicit prefetch lists, the post-optimizer event, asynchronous unshard
in the multi-group parity loop, the reshard toggles of a chunked loss, reset_iter_state after
an exception, a custom forward method, and shard_placement_fn (refused for dims other
than 0). Every one is compared with the unsharded reference, not only run.
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

import shardwise as sw
from shardwise.engine.core.schedule import ShardedState
from shardwise.fsdp2 import fully_shard, register_fsdp_forward_method, share_comm_ctx
from tests.dist.fsdp2.common import (
    DataParallelRef,
    Expect,
    check_sharded_parity,
    full_params_match,
    global_batch,
    ref_step,
    tokens,
    train_parity,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.grad_acc_workers import raf_value
from tests.dist.fsdp2.models import MLP, ChunkedHeadModel, ModelArgs, Transformer


def _transformer(n_layers: int) -> Transformer:
    torch.manual_seed(42)
    return Transformer(ModelArgs(n_layers=n_layers, vocab_size=29, max_seq_len=16, dim=10,
                                 n_heads=2))


def explicit_prefetching(rank: int, world: int, ex: Expect, n_ahead: int) -> None:
    """Each layer names the next `n_ahead` layers for forward prefetch and the previous ones
    for backward prefetch (shardwise accepts the lists and prefetches by its recorded
    order): the numbers are the unsharded ones."""
    model = _transformer(6)
    ref = copy.deepcopy(model)
    for layer in itertools.chain(model.layers, [model]):
        fully_shard(layer)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        ahead = layers[i + 1 : i + 1 + n_ahead]
        behind = layers[max(0, i - n_ahead) : i][::-1]
        if ahead:
            layer.set_modules_to_forward_prefetch(ahead)
        if behind:
            layer.set_modules_to_backward_prefetch(behind)
    train_parity(rank, world, ex, model, ref, tokens(29, 2, 8), _sum, "explicit prefetch",
                 iters=4, optim=torch.optim.AdamW)


class _CountedEvent:
    """torch.Event's surface as set_post_optim_event uses it (CPU streams have no events)."""

    def __init__(self) -> None:
        self.waits = 0

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        self.waits += 1


def post_optim_event(rank: int, world: int, ex: Expect, event: str) -> None:
    """An optimizer step post-hook hands the root a post-optimizer event every step.

    event='stream': upstream's own hook, `current_stream().record_event()` on this device;
    on CPU that returns None, which FSDP2 stores as "no event" (so the same script runs on
    CPU). event='counted': an event object; each one is waited once, by the next forward."""
    model = _transformer(2)
    ref = copy.deepcopy(model)
    for layer in itertools.chain(model.layers, [model]):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    made: list[_CountedEvent] = []

    def step_post_hook(module: nn.Module, optim: object, args: object, kwargs: object) -> None:
        if event == "stream":
            ev = torch.get_device_module("cpu").current_stream().record_event()
        else:
            ev = _CountedEvent()
            made.append(ev)
        module.set_post_optim_event(ev)

    opt.register_step_post_hook(functools.partial(step_post_hook, model))
    for it in range(4):
        xs = global_batch(it, world, tokens(29, 2, 8))
        loss = model(xs[rank]).sum()
        loss.backward()
        ex.close(loss, ref_step(ref, xs, _sum)[rank], f"iter {it}: loss")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    check_sharded_parity(ex, ref, model, rank, world, "after training", grads=False)
    if event == "counted":
        waits = [e.waits for e in made]
        ex.true(waits == [1, 1, 1, 0], f"post-optim events waited {waits}, expected [1, 1, 1, 0]")


def unshard_async_op(rank: int, world: int, ex: Expect, raf: str) -> None:
    """Upstream's test_train_parity_multi_group_unshard_async_op: `_set_unshard_async_op`
    on the root of a multi-unit transformer (the int reshard form included)."""
    model = _transformer(3)
    ref = copy.deepcopy(model)
    value = raf_value(raf, world)
    for layer in itertools.chain(model.layers, [model]):
        fully_shard(layer, reshard_after_forward=value)
    model._set_unshard_async_op(True)
    train_parity(rank, world, ex, model, ref, tokens(29, 3, 16), _sum, "unshard async op",
                 iters=4, check_each=False)


def _chunked(m: nn.Module, toks: torch.Tensor, n_chunks: int, scale: float,
             between: object = None) -> torch.Tensor:
    """Hidden states, the head per chunk (one backward each), then the hidden states'
    backward: a chunked loss. `between(m)` runs after the chunks, before that backward."""
    h = m(toks, skip_head=True)
    total = torch.zeros(())
    grads = []
    for chunk in torch.chunk(h.detach(), n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = m.head(chunk).sum()
        total += loss.detach()
        (loss * scale).backward()
        grads.append(chunk.grad)
        if between is not None:
            between(m, "chunk")
    if between is not None:
        between(m, "after chunks")
    h.backward(torch.cat(grads, dim=1))
    return total


def partial_group_reshard_toggle(rank: int, world: int, ex: Expect, weight_tying: bool,
                                 initial_reshard: bool) -> None:
    """torchtitan's ChunkedCELoss: the head's unit (grouped with norm, or with embed and norm
    when tied) keeps its parameters for the chunk loop (reshard after forward/backward
    off), then the flags are restored and head.reshard() is called before the hidden
    states' backward."""
    dim, vocab, n_chunks = 12, 23, 3
    torch.manual_seed(42)
    model = ChunkedHeadModel(dim, vocab, weight_tying)
    ref = copy.deepcopy(model)
    if weight_tying:
        fully_shard(model.body)
        fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial_reshard)
    else:
        fully_shard(model.embed)
        fully_shard(model.body)
        fully_shard([model.norm, model.head], reshard_after_forward=initial_reshard)
    fully_shard(model)
    head_unit = model.head._sw_unit
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(3):
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)

        def between(m: nn.Module, where: str, it: int = it) -> None:
            if where == "chunk":
                ex.true(head_unit.state is ShardedState.UNSHARDED,
                        f"iter {it}: head unit resharded mid-chunk ({head_unit.state.value})")
                return
            m.head.set_reshard_after_forward(True)
            m.head.set_reshard_after_backward(True)
            m.head.reshard()
            ex.true(head_unit.state is ShardedState.SHARDED,
                    f"iter {it}: head.reshard() left {head_unit.state.value}")

        xs = global_batch(it, world, tokens(vocab, 2, 9))
        loss = _chunked(model, xs[rank], n_chunks, 1.0, between)
        ref_losses = [_chunked(ref, x, n_chunks, 1 / world) for x in xs]
        ex.close(loss, ref_losses[rank], f"iter {it}: chunked loss")
        for n, p in model.named_parameters():
            ex.true(p.grad is not None, f"iter {it}: grad None for {n}")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=(it % 2 == 0))


class _Raiser(nn.Module):
    """Raises in forward ('forward') or, through a hook on its output, in backward once the
    units after it ran their backward and issued their reductions ('backward')."""

    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped = wrapped
        self.armed = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed == "forward":
            raise RuntimeError("boom")
        y = self.wrapped(x)
        if self.armed == "backward":
            y.register_hook(_boom)
        return y


def _boom(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom in backward")


def reset_iter_state_after_exception(rank: int, world: int, ex: Expect, where: str) -> None:
    """A step raises part way: in forward (in the body, after the root's gather, before the
    grouped [norm, head] unit), or in backward (after [norm, head] issued its reduction).
    After reset_iter_state the next steps match the reference, which never saw the failure."""
    torch.manual_seed(42)
    model = ChunkedHeadModel(12, 23, tie=False)
    model.body = _Raiser(model.body)
    ref = copy.deepcopy(model)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    xs = global_batch(0, world, tokens(23, 2, 9))
    model.body.armed = where
    try:
        model(xs[rank], skip_head=where == "forward").sum().backward()
        ex.true(False, f"the armed {where} did not raise")
    except RuntimeError as e:
        ex.true("boom" in str(e), f"unexpected error: {e}")
    model.body.armed = ""
    model.reset_iter_state()
    # A failed step may have written some reduced gradients already (FSDP2 writes each
    # unit's as its reduction is issued): recovery starts from zero gradients.
    model.zero_grad(set_to_none=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for it in range(2):
        xs = global_batch(1 + it, world, tokens(23, 2, 9))
        loss = model(xs[rank]).sum()
        loss.backward()
        ex.close(loss, ref_step(ref, xs, _sum)[rank], f"step {it} after reset: loss")
        for n, p in model.named_parameters():
            ex.true(p.grad is not None, f"grad None for {n} after reset")
        check_sharded_parity(ex, ref, model, rank, world, f"step {it} after reset")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def register_forward_method(rank: int, world: int, ex: Expect) -> None:
    """The root calls vit.forward_features, not vit's forward: registered, it gathers and
    reduces like a forward (upstream's ViT, small)."""

    class VisionTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_proj = nn.Conv2d(3, 17, kernel_size=4, stride=4)

        def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
            return self.patch_proj(imgs).flatten(2).transpose(1, 2)

        def forward(self, imgs: torch.Tensor) -> torch.Tensor:
            return self.forward_features(imgs).sum(dim=1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit, self.projector = VisionTransformer(), nn.Linear(17, 9)

        def forward(self, imgs: torch.Tensor) -> torch.Tensor:
            return self.projector(self.vit.forward_features(imgs))

    torch.manual_seed(42)
    model = Model()
    ref = copy.deepcopy(model)
    fully_shard(model.vit)
    fully_shard(model.projector)
    fully_shard(model)
    register_fsdp_forward_method(model.vit, "forward_features")
    train_parity(rank, world, ex, model, ref,
                 lambda g: torch.randn(2, 3, 12, 12, generator=g), _sum, "forward_features",
                 iters=3)


def shard_placement_fn_largest_dim(rank: int, world: int, ex: Expect) -> None:
    """Upstream's test_train_parity_shard_placement_fn_shard_largest_dim: every parameter
    sharded on its largest dim (Shard(1) for the weights here; 32 does not divide by 3, which
    FSDP2 refuses and shardwise pads) trains as the unsharded reference does, each shard being
    this rank's torch.chunk along that dim, and the full state dict is the reference's."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                          nn.Linear(8, 24))
    ref = copy.deepcopy(model)

    def largest(p: nn.Parameter) -> Shard:
        return Shard(p.shape.index(max(p.shape)))

    for lin in (model[0], model[2]):
        sw.fully_shard(lin, shard_placement_fn=largest)
    sw.fully_shard(model, shard_placement_fn=largest)
    # Upstream's test_shard_placement_fn_contiguous_params_grads: the unsharded parameter
    # forward sees and its gradient are contiguous, whatever the shard dim.
    seen: list[bool] = []

    def check(mod: nn.Module, args: object) -> None:
        w = mod.weight
        seen.append(w.is_contiguous())
        if w.requires_grad and torch.is_grad_enabled():
            w.register_hook(lambda g: seen.append(g.is_contiguous()) or None)

    for lin in (model[0], model[2], model[4]):
        lin.register_forward_pre_hook(check)
    for name, p in model.named_parameters():
        want = Shard(p.shape.index(max(p.shape)))
        ex.true(tuple(p.placements) == (want,), f"{name}: placements {p.placements}, "
                f"want ({want},)")
    train_parity(rank, world, ex, model, ref, lambda g: torch.randn(4, 32, generator=g), _sum,
                 "largest-dim placement", iters=3)
    full_params_match(ex, model, ref, "largest-dim placement")
    ex.true(len(seen) >= 18 and all(seen), f"non-contiguous unsharded weight or gradient: {seen}")


def share_comm_ctx_parity(rank: int, world: int, ex: Expect) -> None:
    """Upstream's test_share_comm_context: separate roots per layer sharing one context
    (FSDP2 shares streams; accepted by shardwise): the numbers are unchanged."""
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(7) for _ in range(3)])
    ref = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer)
    share_comm_ctx(list(model))
    xs = global_batch(3, world, lambda g: torch.randn(4, 3, 7, generator=g))
    loss = model(xs[rank]).sum()
    loss.backward()
    dp = DataParallelRef(ref, world)
    ex.close(loss, dp.step(xs, _sum)[rank], "loss")
    check_sharded_parity(ex, ref, model, rank, world, "after backward")


def unshard_async_overlap(rank: int, world: int, ex: Expect) -> None:
    """Upstream test_fully_shard_comm.py's test_unshard_async: the model's own forward
    issues asynchronous all-reduces on the default group and, between them, unshard(async)
    of the units that will use their results; the units' forward waits for the gather.
    The unsharded reference runs the same all-reduces; its other gradients are averaged
    by hand (DDP)."""
    class ReduceModule(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(dim, dim))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
            y = torch.relu(x @ self.weight)
            return y, dist.all_reduce(y, async_op=True)  # not differentiable: overlap only

    class MLPs(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.mlp1, self.mlp2, self.mlp3 = MLP(dim), MLP(dim), MLP(dim)

        def forward(self, ys: list[torch.Tensor], works: list) -> torch.Tensor:
            out = []
            for y, work, mlp in zip(ys, works, (self.mlp1, self.mlp2, self.mlp3)):
                work.wait()
                out.append(mlp(y))
            return out[0] + out[1] + out[2]

    class ReduceModel(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.r1, self.r2, self.r3 = ReduceModule(dim), ReduceModule(dim), ReduceModule(dim)
            self.mlps = MLPs(dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ys, works = [], []
            for r, mlp in ((self.r1, self.mlps.mlp1), (self.r2, self.mlps.mlp2),
                           (self.r3, self.mlps.mlp3)):
                y, work = r(x)
                ys.append(y)
                works.append(work)
                if isinstance(mlp, sw.ShardedModule):
                    mlp.unshard(async_op=True)
            return self.mlps(ys, works)

    dim = 7
    torch.manual_seed(42)
    ref = ReduceModel(dim)
    torch.manual_seed(42)
    model = ReduceModel(dim)
    for mlp in (model.mlps.mlp1, model.mlps.mlp2, model.mlps.mlp3):
        fully_shard(mlp, reshard_after_forward=False)
    fully_shard(model.mlps)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    sharded = {n for n, p in model.named_parameters() if n.startswith("mlps.")}
    for it in range(3):
        x = global_batch(it, world, lambda g: torch.randn(2, dim, generator=g))[rank]
        loss = model(x).sum()
        loss.backward()
        ref_loss = ref(x).sum()
        ref_loss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        for n, p in model.named_parameters():
            if n not in sharded:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        ex.close(loss, ref_loss, f"iter {it}: loss", rtol=1e-5, atol=1e-5)
        check_sharded_parity(ex, ref.mlps, model.mlps, rank, world, f"iter {it}", rtol=1e-5,
                             atol=1e-5)
        named = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if n not in sharded:
                ex.close(p.grad, named[n].grad, f"iter {it}: grad {n}", rtol=1e-5, atol=1e-5)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
