"""Upstream test_fully_shard_extensions.py: FSDP2's all-gather extensions
(`fsdp_pre_all_gather` / `fsdp_post_all_gather` on a tensor subclass or patched onto a
shard) and tensor-subclass parameters. shardwise runs the hooks ([Note: all-gather
extensions] in engine/core/sharded_param.py; subclass scenarios against torch's FSDP2 in
tests/dist/test_all_gather_extensions.py). What it cannot gather faithfully it refuses, by
name, on every rank and before any collective: a subclass without the hooks (its other data
would be dropped: TwoTensor) and hooks set on the tensor given to fully_shard (they do not
survive sharding, and FSDP2 drops them silently).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from shardwise.fsdp2 import fully_shard
from tests.dist.fsdp2.common import Expect, randn, train_parity
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.models import MLP


def _two_tensor_mlps(n: int = 2) -> nn.Sequential:
    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(n)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            # Two different halves: a dropped second tensor changes the numbers.
            lin.weight = nn.Parameter(TwoTensor(lin.weight, 2 * lin.weight))
    return model


def _pre_all_gather(self: Any, mesh: Any, outer_size: Any = None, outer_stride: Any = None,
                    module: Any = None, mp_policy: Any = None) -> tuple[tuple, None]:
    return (self.to(torch.bfloat16),), None


def _post_all_gather(self: Any, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *,
                     out: Any = None) -> Any:
    (t,) = outputs
    if out is not None:
        out.copy_(t)
        return None
    up = t.to(param_dtype)
    return up, (t, up)


def subclass_param_refused(rank: int, world: int, ex: Expect, kind: str) -> None:
    """kind='two_tensor': TwoTensor weights (upstream's train-parity model);
    kind='hooks': a plain weight that carries fsdp_pre_all_gather before sharding."""
    torch.manual_seed(42)
    if kind == "two_tensor":
        model = _two_tensor_mlps()
        name = "in_proj.weight"
    else:
        model = nn.Sequential(MLP(8, bias=False), MLP(8, bias=False))
        w = model[1].out_proj.weight
        w.fsdp_pre_all_gather = _pre_all_gather.__get__(w)  # type: ignore[attr-defined]
        w.fsdp_post_all_gather = _post_all_gather.__get__(w)  # type: ignore[attr-defined]
        name = "out_proj.weight"
    try:
        for mlp in model:
            fully_shard(mlp)
        fully_shard(model)
        ex.true(False, f"{kind}: fully_shard accepted a parameter it cannot gather faithfully")
    except NotImplementedError as e:
        ex.true(name in str(e) and "fsdp_pre_all_gather" in str(e),
                f"{kind}: the refusal does not name {name} and the extension: {e}")


def _padding_pre(self: Any, mesh: Any, outer_size: Any, outer_stride: Any, module: Any,
                 mp_policy: Any) -> tuple[tuple, Any]:
    """Gathers the shard as it is, padded to the padded shard size (upstream's
    BFloat16AllGatherTensor rule for uneven shards); the metadata is the mesh it saw."""
    rows = -(-outer_size[0] // mesh.size())
    padded = self.new_zeros((rows, *self.shape[1:]))
    padded[: self.shape[0]].copy_(self)
    return (padded,), (mesh.ndim, mesh.size())


def _view_post(self: Any, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *,
               out: Any = None) -> Any:
    _CALLS.append(metadata)
    (t,) = outputs
    if out is not None:
        return None  # `out` views the output, which the gather refilled
    return t, (t,)


_CALLS: list[Any] = []


def patched_after_to_empty(rank: int, world: int, ex: Expect) -> None:
    """Upstream's monkey-patch recipe: meta init, fully_shard, to_empty, init, then the
    extension patched onto each weight's local shard (hooks that gather the padded shard
    and compute with the gathered tensor itself). shardwise runs the hooks from the first
    forward: the pre hook sees the 1-D shard mesh (upstream's HSDP variant checks the same)
    and the model trains as the unsharded reference."""
    with torch.device("meta"):
        model = nn.Sequential(*[MLP(8, dim_multiplier=3, bias=False) for _ in range(2)])
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(42)
    ref = nn.Sequential(*[MLP(8, dim_multiplier=3, bias=False) for _ in range(2)])
    with torch.no_grad():
        for p, rp in zip(model.parameters(), ref.parameters()):
            p.copy_(_distribute_like(rp, p))
    for n, p in model.named_parameters():
        if "weight" in n:
            local = p._local_tensor
            local.fsdp_pre_all_gather = _padding_pre.__get__(local)
            local.fsdp_post_all_gather = _view_post.__get__(local)
    _CALLS.clear()
    train_parity(rank, world, ex, model, copy.deepcopy(ref), randn(2, 8), _sum,
                 "with the patched extension", iters=2)
    ex.true(len(_CALLS) >= 4 and set(_CALLS) == {(1, world)},
            f"the post hook saw {len(_CALLS)} gathers with metadata {set(_CALLS)}")


def _distribute_like(full: torch.Tensor, dparam: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach(), dparam.device_mesh, dparam.placements)
