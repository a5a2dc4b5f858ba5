"""`fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=...)`: FSDP2's full-SPMD-mesh mode.

[Note: dp_mesh_dims] torch 2.13's FSDP2 takes the *whole* device mesh a model lives on
(torchtitan's "full DTensor" mode: dp_replicate, dp_shard, cp, tp dims in one mesh) and a
`DataParallelMeshDims(shard=..., replicate=...)` naming which of its dims are data parallel.
Every parameter is already a DTensor on that mesh, `Replicate()` on the dp dims and whatever
the model-parallel plan chose on the others. shardwise maps this onto the FSDP x TP
machinery ([Note: FSDP x TP] in tp.py) instead of a second path:

- the dp dims become the unit's groups: the shard dims (several are flattened into one, as
  FSDP2 does, e.g. `("dp_shard", "cp")`) are the shard group; the replicate dims (flattened
  likewise) the replicate group, making it HSDP;
- the one remaining dim, if any, plays the TP mesh: a parameter's placement there is its
  TP spec, so its TP-local tensor is sharded on dim 0 across the shard group exactly as in
  the TP recipe (gather, reduce, padding, checkpoints unchanged);
- what differs is only the DTensors the user sees. The module computes with the parameter's
  own spec on the whole mesh (Replicate on the dp dims), and the sharded parameter is a
  DTensor on the same mesh object with `Shard(0)` (or `_StridedShard` when a later dim also
  splits dim 0) on the shard dim and the parameter's other placements unchanged; with
  several shard dims, on the mesh where they are one flattened dim. These are FSDP2's
  placements and meshes (`_init_sharding_spec_spmd`), so DCP and torch's tools read both
  engines' parameters alike.

The gradient autograd leaves on the compute face keeps its dp placements (a DTensor loss
over `Shard(0)` batches makes it `Partial`): its local tensor is what the reduce-scatter sums,
as in FSDP2; only the tp dim is redistributed to the parameter's placement. More than one
non-dp dim (EP x TP) is refused: the TP machinery composes with one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..comm.meshes import concatenate, flatten
from .tp import TPContext


@dataclass(frozen=True)
class SpmdLayout:
    """Where the dp and tp dims of one `fully_shard(..., dp_mesh_dims=...)` mesh sit."""

    mesh: DeviceMesh  # the full SPMD mesh the user passed (and the parameters live on)
    shard: tuple[int, ...]  # indices of the dp shard dims, in mesh order
    replicate: tuple[int, ...]  # indices of the dp replicate dims
    tp_index: int | None  # the one model-parallel dim (None: every dim is dp)
    # The unit's groups as a mesh: 1-D shard, 1-D replicate (DDP) or 2-D (replicate, shard).
    dp_mesh: DeviceMesh

    def tp_spec(self, full: DTensorSpec, tp_mesh: DeviceMesh | None) -> DTensorSpec | None:
        """The parameter's spec seen on the tp dim alone (None without one)."""
        if self.tp_index is None or tp_mesh is None:
            return None
        return DTensorSpec(tp_mesh, (full.placements[self.tp_index],),
                           tensor_meta=full.tensor_meta)

    def sharded_spec(self, placements: tuple[Placement, ...], meta: TensorMeta
                     ) -> DTensorSpec:
        """The sharded parameter's spec: FSDP2's placements, on FSDP2's mesh."""
        out = list(placements)
        for i in self.shard:
            # Dims after i that split dim 0 too: dp splits what they leave (the TP-local
            # rows), which globally interleaves, so it is a strided shard.
            split = math.prod(self.mesh.size(j) for j in range(i + 1, self.mesh.ndim)
                              if isinstance(placements[j], (Shard, _StridedShard))
                              and placements[j].dim == 0)
            out[i] = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
        if len(self.shard) <= 1:
            return DTensorSpec(self.mesh, tuple(out), tensor_meta=meta)
        # Several shard dims are one flattened dim of the spec's mesh (where the first of
        # them sits), preceded by the replicate dim under HSDP; other dims stay.
        meshes: list[DeviceMesh] = []
        spec: list[Placement] = []
        names = self.mesh.mesh_dim_names or ()
        first = min(self.shard)
        for i, name in enumerate(names):
            if (i in self.shard and i != first) or i in self.replicate:
                continue
            if i == first:
                meshes.append(self.dp_mesh)
                if self.replicate:
                    spec.append(Replicate())
                spec.append(out[i])
            else:
                meshes.append(self.mesh[name])
                spec.append(out[i])
        return DTensorSpec(concatenate(meshes), tuple(spec), tensor_meta=meta)


def dims_of(dp_mesh_dims: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(shard names, replicate names) of torch's DataParallelMeshDims (or the same shape)."""
    shard = getattr(dp_mesh_dims, "shard_names", None)
    replicate = getattr(dp_mesh_dims, "replicate_names", None)
    if shard is None or replicate is None:
        raise ValueError(
            f"dp_mesh_dims={dp_mesh_dims!r} must be a "
            "torch.distributed.fsdp.DataParallelMeshDims(shard=..., replicate=...)")
    return tuple(shard), tuple(replicate)


def check_mesh(mesh: object, dp_mesh_dims: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """FSDP2's checks of `mesh` against `dp_mesh_dims` (its `_validate_mesh`, same
    messages, plus the values); no collective."""
    shard, replicate = dims_of(dp_mesh_dims)
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims "
                         f"(got {dp_mesh_dims!r})")
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided "
                         f"(got mesh={mesh!r}): pass the full SPMD DeviceMesh the "
                         "parameters live on, built with mesh_dim_names")
    names = tuple(mesh.mesh_dim_names)
    if not shard:
        # FSDP2 runs these as DDP; the engine's groups would take the replicate dim for a
        # shard dim while the parameters still said Replicate: wrong numbers, so refused.
        raise NotImplementedError(
            f"dp_mesh_dims={dp_mesh_dims!r} names replicate dims only (DDP): shardwise needs "
            f"at least one shard dim among {names}")
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names "
                             f"{names}")
    both = sorted(set(shard) & set(replicate))
    if both or len(set(shard)) != len(shard) or len(set(replicate)) != len(replicate):
        raise ValueError(f"dp_mesh_dims={dp_mesh_dims!r} names a mesh dim twice "
                         f"({both or 'a repeated name'}); each dim is shard or replicate, once")
    others = [n for n in names if n not in shard and n not in replicate]
    if len(others) > 1:
        raise NotImplementedError(
            f"mesh {names} has {len(others)} dims outside dp_mesh_dims ({others}): shardwise "
            "composes data parallelism with one model-parallel dim (tp)")
    return shard, replicate


def check_reshard(reshard_after_forward: object, shard: tuple[str, ...]) -> None:
    """FSDP2 refuses an int group size (hpZ) on an SPMD mesh."""
    if shard and isinstance(reshard_after_forward, int) and not isinstance(
            reshard_after_forward, bool):
        raise NotImplementedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh "
            f"(dp_mesh_dims); got reshard_after_forward={reshard_after_forward}, "
            "use True, False or None")


def check_params(params: Iterable[tuple[str, nn.Parameter]], mesh: DeviceMesh,
                 shard: tuple[str, ...], replicate: tuple[str, ...]) -> None:
    """Every parameter to shard is a DTensor on `mesh` itself, Replicate on each dp dim
    (FSDP2's `_init_sharding_spec_spmd` checks, before any group is made)."""
    names = tuple(mesh.mesh_dim_names or ())
    for fqn, p in params:
        if not isinstance(p, DTensor):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full "
                "SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
                f"'{fqn}'.")
        if p.device_mesh is not mesh:
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, "
                f"but got different mesh objects ({fqn} is on {p.device_mesh}, mesh={mesh})")
        for kind, dims in (("shard", shard), ("replicate", replicate)):
            for name in dims:
                i = names.index(name)
                if not isinstance(p.placements[i], Replicate):
                    raise ValueError(
                        f"Expected Replicate() on DP {kind} dim '{name}' (index {i}) but got "
                        f"{p.placements[i]} (parameter {fqn}, placements {p.placements})")
        other = [pl for i, pl in enumerate(p.placements)
                 if names[i] not in shard and names[i] not in replicate]
        if other and not isinstance(other[0], (Shard, Replicate)):
            raise ValueError(f"{fqn} has placement {other[0]} on its model-parallel dim: "
                             "Shard(d) or Replicate() is supported")


def spmd_context(mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...]
                 ) -> TPContext:
    """The unit's meshes (flattening several dims into one makes a process group, so every
    rank of the mesh calls this alike, as it calls fully_shard)."""
    names = tuple(mesh.mesh_dim_names or ())
    shard_mesh = flatten(mesh, shard) if shard else None
    rep_mesh = flatten(mesh, replicate) if replicate else None
    if shard_mesh is not None and rep_mesh is not None:
        dp_mesh = concatenate([rep_mesh, shard_mesh])
    else:
        dp_mesh = shard_mesh or rep_mesh  # type: ignore[assignment]
    others = [n for n in names if n not in shard and n not in replicate]
    tp_mesh = mesh[others[0]] if others else None
    layout = SpmdLayout(mesh, tuple(names.index(n) for n in shard),
                        tuple(names.index(n) for n in replicate),
                        names.index(others[0]) if others else None, dp_mesh)
    return TPContext(dp_mesh, tp_mesh, mesh, layout)


def context_for_dims(modules: list[nn.Module], mesh: object, dp_mesh_dims: object,
                     reshard_after_forward: object, ignored: set[int]) -> TPContext:
    """Everything `fully_shard(..., dp_mesh_dims=...)` checks, then the unit's meshes.

    The parameters checked are those this call will shard: not ignored, not sharded by an
    earlier call (children, or tied parameters a child owns)."""
    shard, replicate = check_mesh(mesh, dp_mesh_dims)
    assert isinstance(mesh, DeviceMesh)
    check_reshard(reshard_after_forward, shard)
    seen: set[int] = set()
    new: list[tuple[str, nn.Parameter]] = []
    for top in modules:
        for mname, m in top.named_modules():
            for pname, p in m._parameters.items():
                if p is None or id(p) in seen or id(p) in ignored or any(
                        getattr(p, a, None) is not None
                        for a in ("_sw_param", "_sw_orig_of", "_sw_ignored")):
                    continue
                seen.add(id(p))
                new.append((f"{mname}.{pname}" if mname else pname, p))
    check_params(new, mesh, shard, replicate)
    return spmd_context(mesh, shard, replicate)
