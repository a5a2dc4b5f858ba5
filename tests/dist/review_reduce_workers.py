"""Gradient-reduction cases found by review, each against the number an unsharded
run (or DDP) gives: the mean over ranks of each rank's loss gradient, accumulated.

- `direct_accumulate`: NO_SHARD keeps fp32 gradients in place ("direct" parameters). A
  parameter that one rank did not use in the latest backward, but whose gradient from an
  earlier synced backward is still there (accumulation without zero_grad), must still
  contribute that earlier gradient; it contributed zeros and the reduced result then
  replaced the accumulated gradient.
- `direct_unit_called_twice`: the same with one backward: a NO_SHARD unit called twice in
  forward reduces twice; a parameter used by different calls on different ranks kept only
  the second reduction.
- `mixed_path_no_sync`: at 2 ranks (then the pair transport), no_sync with reduce_dtype != the
  gradients' dtype. Whether a bucket reduces "in parts" was decided per rank from the
  local gradients' dtypes (accumulated ones are in the reduce dtype, fresh ones are not),
  so two ranks could take different paths and exchange mismatched messages.
"""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw


def _full(g: torch.Tensor) -> list[float]:
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).tolist()


class _Inner(nn.Module):
    def __init__(self, two: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3)) if two else None
        self.b = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.w * x if self.w is not None else x
        if use_b:
            y = y + self.b * x
        return y


class _Outer(nn.Module):
    def __init__(self, two: bool = False) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.inner = _Inner(two)


def direct_accumulate(rank: int, world: int, reduce_bf16: bool) -> dict[str, list[float]]:
    """Two synced backwards, no zero_grad between: b used on both ranks, then on rank 1
    only. Expected b.grad: 1.5 (mean of x = 1, 2) + 2 / 2 = 2.5."""

    class Net(_Outer):
        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return (self.a * x).sum() + self.inner(x, use_b).sum()

    m = Net()
    mp = sw.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if reduce_bf16 else None
    sw.shard_model(m, sharding_strategy="NO_SHARD", mixed_precision=mp,
                   auto_wrap_policy=lambda mod: isinstance(mod, _Inner))
    x = torch.full((3,), float(rank + 1))
    m(x, True).backward()
    m(x, rank == 1).backward()
    return {"b": _full(m.inner.b.grad), "a": _full(m.a.grad)}


def direct_unit_called_twice(rank: int, world: int) -> list[float]:
    """One backward; the inner NO_SHARD unit runs twice, b used by call 1 on rank 0 and by
    call 2 on rank 1 (all values 1, so d/db = x on each rank). Expected b.grad 1.5."""

    class Net(_Outer):
        def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
            h = self.a * x  # the inner unit's input needs a gradient: it reduces per call
            h = self.inner(h, use_b=rank == 0)
            h = self.inner(h, use_b=rank == 1)
            return h.sum()

    m = Net(two=True)
    sw.shard_model(m, sharding_strategy="NO_SHARD",
                   auto_wrap_policy=lambda mod: isinstance(mod, _Inner))
    x = torch.full((3,), float(rank + 1))
    m(x, rank).backward()
    return _full(m.inner.b.grad)


def mixed_path_no_sync(rank: int, world: int, param_dtype: torch.dtype | None,
                       reduce_dtype: torch.dtype) -> dict[str, list[float]]:
    """FULL_SHARD, 2 ranks: micro-batch 1 under no_sync uses b on rank 0 only, the synced
    micro-batch 2 uses b on rank 1 only; a is used in both everywhere.
    Expected a.grad = 2 * mean(x) = 3.0 and b.grad = (1 + 2) / 2 = 1.5 in every row."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.ones(4))
            self.b = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            y = (self.a * x).sum()
            if use_b:
                y = y + (self.b * x).sum()
            return y

    m = Net()
    mp = sw.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    sw.shard_model(m, auto_wrap_policy=None, mixed_precision=mp)
    x = torch.full((4,), float(rank + 1))
    with sw.no_sync(m):
        m(x, rank == 0).backward()
    m(x, rank == 1).backward()
    return {n: _full(p.grad) for n, p in m.named_parameters()}
