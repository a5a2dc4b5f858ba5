"""Upstream test_fully_shard_training.py's TestFullyShardHSDPTraining (test_train_parity_hsdp):
HYBRID_SHARD through a 2-D (replicate, shard) DeviceMesh given to fully_shard, with
activation checkpointing, CPU offload and gradient accumulation, against the unsharded
reference that averages over every rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed._composable import checkpoint

import shardwise as sw
from tests.dist.fsdp2.common import (
    DataParallelRef,
    Expect,
    check_sharded_parity,
    global_batch,
    randn,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.grad_acc_workers import make_mesh
from tests.dist.fsdp2.models import MLP


def train_parity_hsdp(rank: int, world: int, ex: Expect, mesh: str, reshard_after_forward: bool,
                      ac: bool, mlp_dim: int, sync_at_last: bool, offload: bool) -> None:
    dmesh = make_mesh(mesh, world)
    S = dmesh.size(1)
    torch.manual_seed(42)
    model = nn.Sequential(nn.LayerNorm(mlp_dim, bias=False), MLP(mlp_dim, dim_multiplier=3),
                          MLP(mlp_dim), MLP(mlp_dim, dim_multiplier=3))
    ref = copy.deepcopy(model)
    policy = sw.CPUOffloadPolicy(pin_memory=False) if offload else None
    for m in model:
        if ac:
            checkpoint(m)
        sw.fully_shard(m, mesh=dmesh, reshard_after_forward=reshard_after_forward,
                       offload_policy=policy)
    sw.fully_shard(model, mesh=dmesh, reshard_after_forward=reshard_after_forward,
                   offload_policy=policy)
    shard_rank = rank % S  # (replicate, shard), row-major
    check_sharded_parity(ex, ref, model, shard_rank, S, "before training")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp = DataParallelRef(ref, world)
    microbatches = 3
    for it in range(3):
        for mb in range(microbatches):
            last = mb == microbatches - 1
            if sync_at_last:
                model.set_requires_gradient_sync(last)
            xs = global_batch(10 * it + mb, world, randn(4, mlp_dim))
            loss = model(xs[rank]).sum()
            loss.backward()
            ref_losses = dp.step(xs, _sum, sync=last or not sync_at_last)
            ex.close(loss, ref_losses[rank], f"iter {it} mb {mb}: loss")
        check_sharded_parity(ex, ref, model, shard_rank, S, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=(it % 2 == 0))
        check_sharded_parity(ex, ref, model, shard_rank, S, f"iter {it} after step",
                             grads=False)


def _accumulate_with(fully_shard: object, mp_cls: object, rank: int, world: int,
                     mesh: object, knobs: str) -> tuple[list, dict, dict]:
    """Two optimizer steps of three micro-batches each, with `knobs` ('+'-separated):
    nosync (reduce on the last micro-batch only), keep (reshard_after_forward=False and
    keep parameters until the last backward), mp (bf16 compute, fp32 reduce), hook (an
    all-reduce hook that doubles one unit's reduced gradient), forcesum (the hook sees the
    sum), clip (torch's clip_grad_norm_ before each step). Returns the losses (and norms),
    the last full gradients and the final full parameters."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()

    opts = set(knobs.split("+"))
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(9, 9), *[MLP(9) for _ in range(3)])
    kw: dict = {"mesh": mesh, "reshard_after_forward": "keep" not in opts}
    if "mp" in opts:
        kw["mp_policy"] = mp_cls(param_dtype=torch.bfloat16,  # type: ignore[operator]
                                 reduce_dtype=torch.float32)
    for m in [*model[1:], model]:
        fully_shard(m, **kw)  # type: ignore[operator]
    if "hook" in opts:
        model[1].set_all_reduce_hook(lambda t: t.mul_(2))
    if "forcesum" in opts:
        model[1].set_force_sum_reduction_for_comms(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: list[torch.Tensor] = []
    grads: dict = {}
    for it in range(2):
        for mb in range(3):
            last = mb == 2
            if "nosync" in opts:
                model.set_requires_gradient_sync(last)
            if "keep" in opts:
                model.set_reshard_after_backward(last)
            xs = global_batch(10 * it + mb, world, randn(2, 9))
            loss = model(xs[rank]).sum()
            loss.backward()
            seen.append(loss.detach().float())
        grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        if "clip" in opts:
            seen.append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=bool(it % 2))
    return seen, grads, {n: full(p) for n, p in model.named_parameters()}


def accumulation_vs_fsdp2(rank: int, world: int, ex: Expect, mesh: str, knobs: str) -> None:
    """The same script through torch's FSDP2 and through shardwise (the import switch), on
    the same mesh: losses, gradient norms, gradients and parameters agree."""
    import torch.distributed.fsdp as torch_fsdp

    import shardwise.fsdp2 as sw_fsdp

    dmesh = make_mesh(mesh, world)
    want = _accumulate_with(torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy, rank,
                            world, dmesh, knobs)
    got = _accumulate_with(sw_fsdp.fully_shard, sw_fsdp.MixedPrecisionPolicy, rank, world,
                           dmesh, knobs)
    tol = {"rtol": 1e-5, "atol": 1e-5}
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        ex.close(a, b, f"loss/norm {i}", **tol)
    ex.true(set(got[1]) == set(want[1]), f"gradients present: {sorted(got[1])} vs "
                                         f"FSDP2's {sorted(want[1])}")
    for n in set(got[1]) & set(want[1]):
        ex.close(got[1][n], want[1][n], f"grad {n}", **tol)
    for n in want[2]:
        ex.close(got[2][n], want[2][n], f"param {n}", **tol)
