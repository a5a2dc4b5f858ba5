"""What the ported FSDP2 scenarios share: soft checks, the unsharded reference, shard rows,
and a recorder of shardwise's collectives.

The reference is one unsharded copy of the model, in every rank's process, that runs each
rank's slice of the global batch and averages the gradients, exactly what data parallelism
computes (upstream compares against DDP, which is the same thing). The sharded model runs
only this rank's slice. Parameters and gradients are compared shard by shard, as upstream's
`check_sharded_parity` does: this rank's rows (torch.chunk semantics) of the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import shardwise as sw
from shardwise.engine.core.dtensor import local_of

# upstream's assertEqual tolerances for float32 (torch.testing defaults)
RTOL, ATOL = 1.3e-6, 1e-5


class Expect:
    """Soft assertions: record what differs and go on, so every rank runs the same
    collectives to the end of the case; the harness raises the record afterwards."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def true(self, cond: object, what: str) -> bool:
        if not cond:
            self.failures.append(what)
        return bool(cond)

    def close(self, actual: Any, expected: Any, what: str, rtol: float | None = None,
              atol: float | None = None, check_dtype: bool = True) -> bool:
        if isinstance(actual, torch.Tensor):
            actual = actual.detach()
        if isinstance(expected, torch.Tensor):
            expected = expected.detach()
        try:
            if rtol is None and atol is None and isinstance(actual, torch.Tensor) \
                    and actual.dtype == torch.float32:
                rtol, atol = RTOL, ATOL
            elif (rtol is None) != (atol is None):
                rtol, atol = rtol or RTOL, atol or ATOL
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                                       check_dtype=check_dtype)
            return True
        except AssertionError as e:
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            self.failures.append(f"{what}: " + " | ".join(lines[:4]))
            return False

    def report(self) -> str:
        more = len(self.failures) - 12
        return "\n".join(self.failures[:12]) + (f"\n... and {more} more" if more > 0 else "")


# --- shards ---------------------------------------------------------------------------------


def shard_rows(full: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """This rank's slices of `full` along `dim`, chunked torch.chunk-style (0-d as shape (1,))."""
    t = full.reshape(1) if full.dim() == 0 else full
    c = -(-t.shape[dim] // size)
    start = min(rank * c, t.shape[dim])
    return t.narrow(dim, start, min((rank + 1) * c, t.shape[dim]) - start)


def shard_dim_of(p: torch.Tensor) -> int:
    """The dim a sharded parameter's DTensor face is sharded on (its first Shard placement)."""
    if isinstance(p, DTensor):
        for pl in p.placements:
            if isinstance(pl, Shard):
                return pl.dim % max(p.dim(), 1)
    return 0


def is_sharded(p: torch.Tensor, full_shape: torch.Size, rank: int, size: int) -> bool:
    """Whether the registered parameter `p` is this rank's shard (not the full tensor)."""
    if isinstance(p, DTensor):
        return True  # sharded parameters are DTensors (issue 14), as in FSDP2
    shape = shard_rows(torch.empty(full_shape, device="meta"), rank, size).shape
    return tuple(p.shape) == tuple(shape) and tuple(shape) != tuple(full_shape)


def strip(name: str, prefixes: tuple[str, ...]) -> str:
    for pre in prefixes:
        name = name.replace(pre, "")
    return name


def check_sharded_parity(ex: Expect, ref: nn.Module, model: nn.Module, rank: int, size: int,
                         what: str, prefixes: tuple[str, ...] = (), grads: bool = True,
                         rtol: float | None = None, atol: float | None = None) -> None:
    """Every sharded parameter (and its gradient) equals this rank's rows of the reference.

    A reference gradient of None must be None here too (an unused parameter is not "zero");
    a rank whose shard of a parameter is empty may hold None or an empty gradient.
    """
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        rp = named[strip(name, prefixes)]
        dim = shard_dim_of(p)
        mine = shard_rows(rp.detach(), rank, size, dim)
        if not ex.close(local_of(p.detach()).reshape(mine.shape), mine, f"{what}: param {name}",
                        rtol, atol):
            continue
        if not grads:
            continue
        if rp.grad is None:
            ex.true(p.grad is None, f"{what}: grad {name} should be None (the reference has "
                                    f"none), got {_describe(p.grad)}")
        elif p.grad is None:
            ex.true(mine.numel() == 0, f"{what}: grad {name} is None, the reference has one")
        else:
            ex.close(local_of(p.grad).reshape(mine.shape), shard_rows(rp.grad, rank, size, dim),
                     f"{what}: grad {name}", rtol, atol)


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"{tuple(t.shape)} tensor, max |x| {t.abs().max().item() if t.numel() else 0:.3g}"


def full_params_match(ex: Expect, model: nn.Module, ref: nn.Module, what: str,
                      prefixes: tuple[str, ...] = ()) -> None:
    full = sw.full_state_dict(model)
    named = dict(ref.named_parameters())
    for k, v in full.items():
        k2 = strip(k, prefixes)
        if k2 in named:
            ex.close(v, named[k2].detach(), f"{what}: full param {k}")


# --- reference ------------------------------------------------------------------------------


class DataParallelRef:
    """The unsharded reference, computing what data parallelism computes in shardwise's
    order: each rank's gradient on its own slice, kept per rank while not synchronizing,
    then summed in rank order, divided by the world size and added to `.grad`. In that
    order fp32 results match bit for bit, so upstream's fp32 tolerances hold."""

    def __init__(self, module: nn.Module, world: int) -> None:
        self.module, self.world = module, world
        self.local: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

    def step(self, slices: list[Any], loss_of: Callable[[nn.Module, Any], torch.Tensor],
             sync: bool | Callable[[str], bool] = True) -> list[torch.Tensor]:
        params = dict(self.module.named_parameters())
        saved = {n: p.grad for n, p in params.items()}
        losses = []
        for r, x in enumerate(slices):
            for p in params.values():
                p.grad = None
            loss = loss_of(self.module, x)
            loss.backward()
            losses.append(loss.detach())
            for n, p in params.items():
                if p.grad is not None:
                    acc = self.local[r].get(n)
                    self.local[r][n] = p.grad if acc is None else acc + p.grad
        for n, p in params.items():
            p.grad = saved[n]
            if not (sync(n) if callable(sync) else sync):
                continue
            grads = [self.local[r].pop(n, None) for r in range(self.world)]
            if all(g is None for g in grads):
                continue
            total = torch.zeros_like(p) if grads[0] is None else grads[0].clone()
            for g in grads[1:]:
                if g is not None:
                    total.add_(g)
            total.div_(self.world)
            p.grad = total if p.grad is None else p.grad.add_(total)
        return losses


def sum_loss(m: nn.Module, x: Any) -> torch.Tensor:
    """The loss most cases train on: the sum of the model's output."""
    return m(x).sum()


def ref_step(ref: nn.Module, slices: list[Any], loss_of: Callable[[nn.Module, Any], torch.Tensor]
             ) -> list[torch.Tensor]:
    """One synchronized data-parallel backward of the reference; returns each rank's loss."""
    return DataParallelRef(ref, len(slices)).step(slices, loss_of)


def global_batch(seed: int, world: int, make: Callable[[torch.Generator], torch.Tensor]
                 ) -> list[torch.Tensor]:
    """One input per rank, the same lists on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [make(g) for _ in range(world)]


def randn(*shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(shape, generator=g)


def tokens(vocab: int, *shape: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(0, vocab, shape, generator=g)


def train_parity(rank: int, world: int, ex: Expect, model: nn.Module, ref: nn.Module,
                 make: Callable[[torch.Generator], Any],
                 loss_of: Callable[[nn.Module, Any], torch.Tensor], what: str,
                 iters: int = 5, lr: float = 1e-2, prefixes: tuple[str, ...] = (),
                 check_each: bool = True, optim: type = torch.optim.Adam) -> None:
    """Upstream's training loop: each iteration zero_grad (set_to_none alternating),
    forward, backward, step; losses compared every iteration, shards at every check."""
    opt, ref_opt = optim(model.parameters(), lr=lr), optim(ref.parameters(), lr=lr)
    for i in range(iters):
        xs = global_batch(100 + i, world, make)
        for o in (opt, ref_opt):
            o.zero_grad(set_to_none=(i % 2 == 0))
        loss = loss_of(model, xs[rank])
        loss.backward()
        ref_losses = ref_step(ref, xs, loss_of)
        ex.close(loss, ref_losses[rank], f"{what} iter {i}: loss")
        if check_each:
            check_sharded_parity(ex, ref, model, rank, world, f"{what} iter {i}", prefixes)
        opt.step()
        ref_opt.step()
    check_sharded_parity(ex, ref, model, rank, world, f"{what} after training", prefixes)


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, sw.ShardedModule)]


# --- collectives ----------------------------------------------------------------------------


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, str, int, torch.dtype]]]:
    """Record shardwise's collectives as (op, unit label, numel, dtype), in issue order.

    all_gather: numel of this rank's send chunk; reduce_scatter: numel of this rank's output
    (the reduced shard); all_reduce/broadcast: numel of the tensor.
    """
    from shardwise.engine.comm import collectives as C
    from shardwise.engine.comm import transport as T

    log: list[tuple[str, str, int, torch.dtype]] = []
    # Units move buffers through their group's transport object; other callers use C.
    patched: list[tuple[Any, str, Any]] = [
        (T.Transport, "all_gather", lambda self, out, send, n, *a, **k: send[:n]),
        (T.AllToAllTransport, "all_gather", lambda self, out, send, n, *a, **k: send[:n]),
        (T.Transport, "reduce_scatter", lambda self, out, full, *a, **k: out),
        (T.AllToAllTransport, "reduce_scatter", lambda self, out, full, *a, **k: out),
        (C, "all_reduce", lambda t, *a, **k: t),
        (C, "broadcast", lambda t, *a, **k: t),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patched]

    def wrap(orig: Callable[..., Any], op: str, tensor_of: Callable[..., torch.Tensor]):
        def call(*args: Any, **kwargs: Any) -> Any:
            t = tensor_of(*args, **kwargs)
            log.append((op, kwargs.get("label", ""), t.numel(), t.dtype))
            return orig(*args, **kwargs)
        return call

    for (owner, name, tensor_of), (_, _, orig) in zip(patched, saved):
        setattr(owner, name, wrap(orig, name,
                                  tensor_of))
    try:
        yield log
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)


def count(log: list[tuple[str, str, int, torch.dtype]], op: str) -> int:
    return sum(1 for rec in log if rec[0] == op)
