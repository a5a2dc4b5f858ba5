"""Megatron-style tensor parallelism for the GPT of model.py (`shardwise train --parallel.tp`).

The GPT keeps its weights as bare parameters used through `F.linear`, so PyTorch's
`ColwiseParallel` / `RowwiseParallel` (which parallelize `nn.Linear` modules) do not apply;
the plan is the same one, written out:

- `attn.w_qkv` and `mlp.w_in` are split on dim 0 (colwise): each TP rank holds whole heads
  (the fused projection is laid out head-major, (n_head, 3, head_dim) rows, so a dim-0
  chunk is the q, k and v of n_head / tp heads) and a slice of the MLP's hidden units;
- `attn.w_out` and `mlp.w_out` are split on dim 1 (rowwise): each rank multiplies its
  slice and the partial sums are all-reduced across tp;
- the embedding (tied to the head), position table and norms stay whole on every TP rank.

Per block and step that is Megatron's two all-reduces forward (`tp_exit`, after attention
and after the MLP) and two backward (`tp_enter`, the gradient of each branch's input), each
of batch x seq x d_model elements. The weights are DTensors on the TP mesh, so fully_shard
shards them as any TP parameter ([Note: FSDP x TP] in engine/core/dtensor.py); the modules compute
with their local tensors (`local`), whose gradients autograd hands back to the DTensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..engine.comm import collectives as C


def local(w: torch.Tensor) -> torch.Tensor:
    """The TP-local weight (differentiable: its gradient becomes the DTensor's)."""
    return w.to_local() if isinstance(w, DTensor) else w


class _ReduceGrad(torch.autograd.Function):
    """Megatron's f: identity forward; the input's gradient is all-reduced across tp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Each rank's gradient is a partial sum (its heads / hidden units only).
        grad = grad.contiguous().clone()
        C.all_reduce(grad, ctx.group, label="tp f (input grad)")
        return grad, None


class _ReduceOut(torch.autograd.Function):
    """Megatron's g: the partial sums of a rowwise matmul all-reduced across tp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        C.all_reduce(out, group, label="tp g (output)")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# Through the communication layer, not DTensor's redistribute: its collectives would bypass
# the exit drain's handoff, the debug fingerprints and the named errors (engine/collectives).
def tp_enter(x: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Megatron's f: identity forward; the input's gradient is all-reduced across tp."""
    if mesh is None:
        return x
    return _ReduceGrad.apply(x, mesh.get_group())


def tp_exit(x: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Megatron's g: the partial sums of a rowwise matmul all-reduced across tp."""
    if mesh is None:
        return x
    return _ReduceOut.apply(x, mesh.get_group())


def check_tp(tp: int, n_head: int, d_model: int, ffn_dim: int) -> None:
    """ValueError unless `tp` divides the heads and the hidden sizes (no collective)."""
    for name, n in (("n_head", n_head), ("d_model", d_model), ("ffn_dim", ffn_dim)):
        if n % tp:
            raise ValueError(f"parallel.tp={tp} must divide model.{name}={n} (each TP rank "
                             f"holds {name} / tp); divisors of it up to 8: "
                             f"{[k for k in range(1, 9) if n % k == 0]}")


def check_world(tp: int, world: int, dims: dict[str, int] | None = None) -> None:
    """ValueError unless `tp` divides the world size (and, given the model's `dims`, those).

    The allowed values listed are the ones that pass every check, so the suggestion is never
    refused by the next one (3 ranks of a 4-head model: only 1).
    """
    dims = dims or {}
    allowed = [k for k in range(1, world + 1)
               if world % k == 0 and all(n % k == 0 for n in dims.values())]
    if tp < 1 or world % tp:
        raise ValueError(f"parallel.tp={tp} must divide the world size {world} (ranks are "
                         f"dp x tp); allowed here: {allowed}")
    for name, n in dims.items():
        if n % tp:
            raise ValueError(f"parallel.tp={tp} must divide model.{name}={n} (each TP rank "
                             f"holds {name} / tp); allowed here: {allowed}")


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, dim: int) -> None:
    p = module._parameters[name]
    assert p is not None
    # Every rank built the same weights (same seed), so each cuts its own piece locally:
    # distribute_tensor would scatter from rank 0 through DTensor's own collectives.
    shape, offs = compute_local_shape_and_global_offset(p.shape, mesh, [Shard(dim)])
    local = p.detach().narrow(dim, offs[dim], shape[dim]).contiguous()
    d = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=p.shape,
                           stride=p.stride())
    module._parameters[name] = nn.Parameter(d, requires_grad=p.requires_grad)


def parallelize_gpt(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Apply the plan above to every block of `model` (a model.GPT), in place."""
    cfg = model.cfg  # type: ignore[attr-defined]
    check_tp(tp_mesh.size(), cfg.n_head, cfg.d_model, cfg.ffn_dim)
    for block in model.blocks:  # type: ignore[attr-defined]
        _distribute(block.attn, "w_qkv", tp_mesh, 0)
        _distribute(block.attn, "w_out", tp_mesh, 1)
        _distribute(block.mlp, "w_in", tp_mesh, 0)
        _distribute(block.mlp, "w_out", tp_mesh, 1)
        block.attn.tp_mesh = tp_mesh
        block.mlp.tp_mesh = tp_mesh
    return model
