"""The DTensor face of a shard: what PyTorch's own tools see of a sharded parameter.

[Note: DTensor parameters] A sharded parameter is registered on its module as a DTensor
(`Shard(0)` on the shard mesh; `(Replicate(), Shard(0))` on a 2-D HYBRID_SHARD mesh) whose
local tensor *is* the engine's shard view (`ShardedParam.local`, a view into the padded
chunk): same storage, so the optimizer, `model.state_dict()`, `torch.nn.utils.clip_grad_norm_`
and `torch.distributed.checkpoint` read and write the shard the all-gather sends. DTensor's
`Shard(0)` follows `torch.chunk` (ceil-sized chunks, trailing ranks short or empty), which is
exactly [Note: layout], so no data moves. The engine itself (gather, reduce, checkpoints, grad
norm) works on the plain local tensors and never dispatches through DTensor.

Kept plain, deliberately (the tensor *is* the whole parameter on every rank, so torch's tools
already give the unsharded answer on it): parameters of a shard group of one rank (NO_SHARD,
a one-rank world). A 0-d parameter (FSDP2 refuses them) is one row held by shard rank 0
([Note: layout]), and a scalar cannot be `Shard(0)`: its face is a `Shard(0)` DTensor of
global shape (1,) (under TP, on the (dp, tp) mesh), so torch's tools (state dicts, DCP,
`clip_grad_norm_`) see its value once, where it lives; a plain 0-d value loaded into it
becomes this rank's row (sd_hooks.py). A plain face there made them read the other ranks'
empty rows as copies of the parameter (DCP stored it empty). `sw.full_state_dict` and
shardwise's own checkpoints give it back with shape ().
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ..comm import collectives as C


def world_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over the default process group (mesh=None means the whole world)."""
    return DeviceMesh.from_group(C.world_group(), device_type)


def hybrid_mesh(replicate_group: object, shard_group: object, replicate: int, shard: int,
                device_type: str) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh over groups made by `collectives.new_groups_2d`."""
    layout = torch.arange(replicate * shard, dtype=torch.int).view(replicate, shard)
    return DeviceMesh.from_group([replicate_group, shard_group], device_type,  # type: ignore[list-item]
                                 mesh=layout, mesh_dim_names=("replicate", "shard"))


def placements_for(mesh: DeviceMesh, dim: int = 0) -> tuple[Placement, ...]:
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def spec_for(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype,
             dim: int = 0) -> DTensorSpec:
    """The sharding spec of a parameter of global `shape` sharded on `dim` over `mesh`."""
    meta = TensorMeta(shape, contiguous_stride(shape), dtype)
    return DTensorSpec(mesh, placements_for(mesh, dim), tensor_meta=meta)


def wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor around `local` (no copy, no communication, no autograd edge).

    Built from the spec directly rather than `DTensor.from_local`, whose argument handling
    costs more than the wrap itself (it runs per parameter per step for gradients).
    """
    if local.dtype != spec.tensor_meta.dtype:  # type: ignore[union-attr]
        meta = TensorMeta(spec.shape, spec.stride, local.dtype)
        spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return DTensor(local, spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of a DTensor; a plain tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def uses_all_gather_extension(t: torch.Tensor) -> bool:
    """Whether `t` or its local tensor carries FSDP2's all-gather extension
    (`fsdp_pre_all_gather`; [Note: all-gather extensions] in extension.py)."""
    return any(hasattr(x, "fsdp_pre_all_gather") for x in (t, local_of(t)))
