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
a one-rank world). A 0-d parameter (FSDP2 refuses them) cannot be `Shard(0)`: every rank
holds its value ([Note: 0-d parameters] in sharded_param.py), and its face is a DTensor of
global shape () placed `Replicate()` on every dim of the mesh (under TP, the (dp, tp) mesh),
so torch's tools (state dicts, DCP, `clip_grad_norm_`) see shape () and count it once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..comm import collectives as C
from ..comm.process_group import concatenate, flatten


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


def replicated(mesh: DeviceMesh, dtype: torch.dtype) -> DTensorSpec:
    """A 0-d parameter's spec: shape (), `Replicate()` on every dim of `mesh`."""
    meta = TensorMeta(torch.Size(()), (), dtype)
    return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def spec_for(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype,
             dim: int = 0) -> DTensorSpec:
    """The sharding spec of a parameter of global `shape` sharded on `dim` over `mesh`."""
    if len(shape) == 0:
        return replicated(mesh, dtype)
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
    if _DTENSOR_NEW is not None:
        return _DTENSOR_NEW(DTensor, local, spec, requires_grad=local.requires_grad)
    return DTensor(local, spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]


# DTensor's constructor is this C function (it sets `_spec` and `_local_tensor`) followed by
# an `__init__` that does nothing but pays a dynamo-disable and an export wrapper: a quarter
# of a gradient's wrap, per parameter per step. Older torch builds the DTensor in Python.
_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of a DTensor; a plain tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def uses_all_gather_extension(t: torch.Tensor) -> bool:
    """Whether `t` or its local tensor carries FSDP2's all-gather extension
    (`fsdp_pre_all_gather`; [Note: all-gather extensions] in sharded_param.py)."""
    return any(hasattr(x, "fsdp_pre_all_gather") for x in (t, local_of(t)))


# --------------------------------------------------------------------------------------------------
# FSDP x tensor parallelism: sharding parameters that are already TP DTensors.
#
# [Note: FSDP x TP] The recipe is torchtitan's: `parallelize_module(block, mesh["tp"], plan)`
# first, then `fully_shard(block, mesh=mesh["dp"])` per block and on the root. A parameter
# that `parallelize_module` made a DTensor on the TP mesh holds, on this rank, its *TP-local*
# tensor (a colwise weight: a block of its rows, the output features; a rowwise weight: a
# block of its columns). shardwise shards that local tensor on dim 0 across the dp mesh
# exactly as it shards a plain parameter ([Note: layout]), so the engine's gather, reduce
# and padding code is unchanged:
#
# - all-gather across dp rebuilds the TP-local tensor; the module sees it wrapped as the
#   original TP DTensor (same spec), so the TP plan's forward (DTensor weights, redistributed
#   inputs/outputs) runs as without FSDP;
# - the gradient autograd leaves on that DTensor is brought back to the TP placement (a
#   Partial gradient becomes Replicate, as FSDP2 does) and its local tensor is reduce-scattered
#   across dp only: TP ranks hold different pieces, or identical copies of a replicated one;
# - the sharded parameter the optimizer sees is a DTensor on the (dp, tp) mesh with FSDP2's
#   2-D placements: `(Shard(0), Shard(1))` for a rowwise weight, `(_StridedShard(0, tp),
#   Shard(0))` for a colwise one (dp splits the TP-local rows, not the global ones), and
#   `(Shard(0), Replicate())` for a parameter the plan left replicated.
#
# Parameters of the same units that are *not* TP DTensors (norms, the embedding and head when
# the plan leaves them alone) are replicated across tp; in a TP model they still get a DTensor
# face on the (dp, tp) mesh, `(Shard(0), Replicate())`, so every parameter lives on one mesh
# and PyTorch's `clip_grad_norm_`, optimizers and DCP see one consistent layout.
#
# Sequence parallelism makes a norm weight a Replicate DTensor whose gradient is a TP Partial
# sum; `grad_local` reduces it to the TP placement, but only the Megatron plan (no sequence
# parallelism) is tested.


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def _root(mesh: DeviceMesh) -> DeviceMesh:
    return mesh._get_root_mesh()


@dataclass(frozen=True)
class TPContext:
    """The meshes of one `fully_shard` call on a tensor-parallel model."""

    dp_mesh: DeviceMesh  # 1-D (dp) or 2-D (replicate, shard) for HSDP x TP
    # 1-D; None: no model-parallel dim at all (dp_mesh_dims naming every dim of the mesh).
    tp_mesh: DeviceMesh | None
    spmd_mesh: DeviceMesh  # dp dims then the tp dim: where sharded parameters live
    # fully_shard(dp_mesh_dims=...) ([Note: dp_mesh_dims] in dtensor.py): the parameters are
    # DTensors on `spmd_mesh` itself, in the user's order of dims; None: the TP recipe.
    spmd: SpmdLayout | None = None

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    def dp_placements(self, tp_shards_dim0: bool) -> tuple[Placement, ...]:
        # Colwise: dp splits the TP-local rows, so globally the dp chunks interleave with
        # the tp ones; _StridedShard says exactly that (FSDP2 uses the same).
        sh: Placement = (_StridedShard(0, split_factor=self.tp_size)
                         if tp_shards_dim0 and self.tp_size > 1 else Shard(0))
        return (Replicate(), sh) if self.dp_mesh.ndim == 2 else (sh,)


def _tp_meshes(module: nn.Module) -> list[DeviceMesh]:
    """TP meshes of the parameters under `module`: raw TP DTensors and sharded ones."""
    found: list[DeviceMesh] = []
    for p in module.parameters():
        sp = getattr(p, "_sw_param", None) or getattr(p, "_sw_orig_of", None)
        mesh = None
        if sp is not None:
            tp = getattr(sp, "tp", None)
            mesh = tp.ctx.tp_mesh if tp is not None else None
        elif isinstance(p, DTensor):
            mesh = p.device_mesh
        if mesh is not None and not any(mesh is m or mesh == m for m in found):
            found.append(mesh)
    return found


def context_for(module: nn.Module, mesh: object | None, fqns: Iterable[str] = ()) -> (
        TPContext | None):
    """The TP context of a `fully_shard(module, mesh=...)` call, or None for a plain model.

    Raises ValueError before any collective when the mesh cannot be the data-parallel part
    of the TP parameters' mesh.
    """
    tp_meshes = _tp_meshes(module)
    if not tp_meshes:
        return None
    where = f"{type(module).__name__}"
    if len(tp_meshes) > 1:
        raise ValueError(f"{where}: parameters are DTensors on {len(tp_meshes)} different "
                         f"meshes {tp_meshes}; shardwise composes with one 1-D TP mesh")
    tp_mesh = tp_meshes[0]
    if tp_mesh.ndim != 1:
        raise ValueError(f"{where}: a parameter is a DTensor on the {tp_mesh.ndim}-D mesh "
                         f"{tp_mesh}; tensor parallelism over a 1-D mesh (mesh['tp']) is "
                         "supported")
    hint = ("build mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
            "call parallelize_module(block, mesh['tp'], plan), then "
            "fully_shard(block, mesh=mesh['dp'])")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"{where} holds tensor-parallel parameters (DTensors on {tp_mesh}) "
                         f"but mesh={mesh!r} has no dp dimension: pass the data-parallel "
                         f"part of the same mesh; {hint}")
    dp_names, tp_names = _names(mesh), _names(tp_mesh)
    if _root(mesh) != _root(tp_mesh) or not dp_names or set(dp_names) & set(tp_names):
        raise ValueError(f"{where}: mesh={mesh} is not a dp dimension beside the TP mesh "
                         f"{tp_mesh} (dims {dp_names} vs {tp_names}, both must be named "
                         f"dims of one DeviceMesh and disjoint); {hint}")
    if mesh.ndim > 2:
        raise ValueError(f"{where}: mesh={mesh} has {mesh.ndim} dims; the dp part is 1-D "
                         "(FSDP) or 2-D (replicate, shard: HSDP)")
    spmd = DeviceMesh._concatenate([mesh, tp_mesh])
    return TPContext(mesh, tp_mesh, spmd)


def check_params_in_place(units: Iterable[object]) -> None:
    """Refuse a model whose parameters were replaced after sharding (before a collective).

    `parallelize_module` run after `fully_shard` distributes FSDP's shards as if they were
    whole parameters and registers new Parameter objects the engine never sees.
    """
    for u in units:
        for sp in u.params:  # type: ignore[attr-defined]
            for ref in sp.refs:
                held = ref.module._parameters.get(ref.name)
                if isinstance(held, DTensor) and getattr(held, "_sw_param", None) is None:
                    raise ValueError(
                        f"{ref.fqn} was replaced after fully_shard by a DTensor "
                        f"({held.placements} on {held.device_mesh}): apply tensor "
                        "parallelism (parallelize_module) before fully_shard")


class TPParam:
    """How one parameter of a TP model is laid out across (dp, tp).

    `tp_spec` is the TP DTensor's spec (None: a plain parameter, replicated across tp).
    The engine shards `local_param` (the TP-local tensor) and never sees global shapes.
    """

    def __init__(self, param: torch.Tensor, ctx: TPContext) -> None:
        self.ctx = ctx
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        # What the module computes with: the TP DTensor, or under dp_mesh_dims the
        # parameter's own spec on the whole mesh (Replicate on its dp dims).
        self.face_spec = self.tp_spec
        if ctx.spmd is not None and self.tp_spec is not None:
            self.tp_spec = ctx.spmd.tp_spec(self.tp_spec, ctx.tp_mesh)
        self.global_shape = tuple(param.shape)
        # The global dim the TP placement splits (None: replicated across tp) and where
        # this rank's TP-local tensor starts along it.
        self.shard_dim: int | None = None
        self.offset = 0
        if self.tp_spec is not None:
            (pl,) = self.tp_spec.placements
            if isinstance(pl, Shard):
                self.shard_dim = pl.dim % max(len(self.global_shape), 1)
                _, offs = compute_local_shape_and_global_offset(
                    self.global_shape, ctx.tp_mesh, self.tp_spec.placements)
                self.offset = offs[self.shard_dim]
            elif not isinstance(pl, Replicate):
                raise ValueError(f"a TP parameter with placement {pl} is not supported: "
                                 "Shard(d) or Replicate() on the TP mesh")

    def local_param(self, param: torch.Tensor) -> torch.Tensor:
        return param._local_tensor if isinstance(param, DTensor) else param

    @property
    def tp_sharded(self) -> bool:
        """Whether TP ranks hold different pieces (so norms add up across tp)."""
        return self.shard_dim is not None and self.ctx.tp_size > 1

    def sharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The sharded parameter's spec on the (dp, tp) mesh, global shape."""
        if not self.global_shape:  # [Note: 0-d parameters] in sharded_param.py
            mesh = self.face_spec.mesh if self.ctx.spmd is not None and self.face_spec \
                else self.ctx.spmd_mesh
            return replicated(mesh, dtype)
        shape = self.global_shape
        meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype)
        if self.ctx.spmd is not None:
            assert self.face_spec is not None, "dp_mesh_dims parameters are DTensors"
            return self.ctx.spmd.sharded_spec(self.face_spec.placements, meta)
        tp_pl = self.tp_spec.placements if self.tp_spec is not None else (Replicate(),)
        placements = (*self.ctx.dp_placements(self.shard_dim == 0), *tp_pl)
        return DTensorSpec(self.ctx.spmd_mesh, placements, tensor_meta=meta)

    def compute_face(self, local_full: torch.Tensor) -> torch.Tensor:
        """What the module computes with: the TP DTensor around the gathered local tensor."""
        if self.face_spec is None:
            return local_full
        spec = self.face_spec
        if local_full.dtype != spec.tensor_meta.dtype:  # type: ignore[union-attr]
            meta = TensorMeta(spec.shape, spec.stride, local_full.dtype)
            spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
        return DTensor(local_full, spec, requires_grad=local_full.requires_grad)  # type: ignore[call-arg]

    def grad_local(self, grad: torch.Tensor) -> torch.Tensor:
        """The plain TP-local gradient of the compute face, in the TP placement."""
        if not isinstance(grad, DTensor):
            return grad
        local = grad._local_tensor
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor: the data, now
        local = wait() if callable(wait) else local
        src = grad.placements[0]
        if self.ctx.spmd is not None:
            # The dp dims' placements stay as autograd left them (Partial, or Replicate
            # over different values): the reduce-scatter over dp is what sums them, as
            # in FSDP2. Only the tp dim is brought back to the parameter's placement.
            t = self.ctx.spmd.tp_index
            if t is None or self.tp_spec is None:
                return local
            src = grad.placements[t]
        if self.tp_spec is not None and src != self.tp_spec.placements[0]:
            # A replicated parameter used on sharded activations gets a Partial gradient.
            local = self._redistribute(local, src, self.tp_spec.placements[0])
        return local

    def _redistribute(self, local: torch.Tensor, src: Placement, dst: Placement
                      ) -> torch.Tensor:
        """A 1-D TP redistribution through the communication layer (not DTensor's own
        collectives, which the exit drain, debug fingerprints and named errors cannot see):
        to Replicate first (all-reduce a Partial, join a Shard), then this rank's piece."""
        assert self.ctx.tp_mesh is not None, "a redistribution needs a tp dim"
        group = self.ctx.tp_mesh.get_group()
        if isinstance(src, Partial):
            if src.reduce_op != "sum":
                raise ValueError(f"a TP gradient with placement {src} is not supported: "
                                 "Partial(sum) is")
            local = local.contiguous().clone()
            C.all_reduce(local, group, label="tp grad (partial -> replicate)")
        elif isinstance(src, Shard):
            d = src.dim % local.dim()
            local = C.all_gather_dim(local, d, self.global_shape[d], group,
                                     label="tp grad (shard -> replicate)")
        elif not isinstance(src, Replicate):
            raise ValueError(f"a TP gradient with placement {src} is not supported")
        if isinstance(dst, Shard):
            d = dst.dim % local.dim()
            shape, offs = compute_local_shape_and_global_offset(
                self.global_shape, self.ctx.tp_mesh, (dst,))
            return local.narrow(d, offs[d], shape[d]).contiguous()
        return local

    # --- full tensors (state dicts, export, checkpoints) -------------------------------

    def local_piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a global tensor."""
        if self.shard_dim is None:
            return full
        local_shape, _ = compute_local_shape_and_global_offset(
            self.global_shape, self.ctx.tp_mesh, self.tp_spec.placements)  # type: ignore[union-attr]
        return full.narrow(self.shard_dim, self.offset, local_shape[self.shard_dim])

    def full_tensor(self, local_full: torch.Tensor) -> torch.Tensor:
        """The global tensor from the gathered TP-local one (a collective over tp)."""
        if self.tp_spec is None or self.shard_dim is None or self.ctx.tp_size == 1:
            return local_full
        return C.all_gather_dim(local_full, self.shard_dim, self.global_shape[self.shard_dim],
                                self.ctx.tp_mesh.get_group(), label="tp full_tensor")

    def checkpoint_rows(self, row_start: int, row_end: int) -> tuple[int, int]:
        """The rows [start, end) of the global tensor whose pieces this rank stores.

        Colwise: the TP-local rows sit at the TP offset, a contiguous global row range.
        Rowwise and replicated: the same global rows on every TP rank (columns are joined
        across tp when saving, `checkpoint_local`, and split when loading, `from_rows`).
        """
        if self.shard_dim == 0:
            return self.offset + row_start, self.offset + row_end
        return row_start, row_end

    def writes(self) -> bool:
        """Whether this TP rank stores its rows: all of them for colwise, else TP rank 0."""
        return (self.shard_dim == 0 or self.ctx.tp_mesh is None
                or self.ctx.tp_mesh.get_local_rank() == 0)

    def checkpoint_local(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's stored rows, full width (joined across tp for a rowwise weight)."""
        if self.shard_dim is None or self.shard_dim == 0 or self.ctx.tp_size == 1:
            return rows
        d = self.shard_dim
        return C.all_gather_dim(rows, d, self.global_shape[d], self.ctx.tp_mesh.get_group(),
                                label="tp checkpoint rows")

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `checkpoint_local`: this rank's columns of full-width stored rows."""
        if self.shard_dim is None or self.shard_dim == 0:
            return rows
        local_shape, _ = compute_local_shape_and_global_offset(
            self.global_shape, self.ctx.tp_mesh, self.tp_spec.placements)  # type: ignore[union-attr]
        full_rows = rows.reshape(-1, *self.global_shape[1:])
        return full_rows.narrow(self.shard_dim, self.offset,
                                local_shape[self.shard_dim]).contiguous()


# --------------------------------------------------------------------------------------------------
# `fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=...)`: FSDP2's full-SPMD-mesh mode.
#
# [Note: dp_mesh_dims] torch 2.13's FSDP2 takes the *whole* device mesh a model lives on
# (torchtitan's "full DTensor" mode: dp_replicate, dp_shard, cp, tp dims in one mesh) and a
# `DataParallelMeshDims(shard=..., replicate=...)` naming which of its dims are data parallel.
# Every parameter is already a DTensor on that mesh, `Replicate()` on the dp dims and whatever
# the model-parallel plan chose on the others. shardwise maps this onto the FSDP x TP
# machinery ([Note: FSDP x TP] in dtensor.py) instead of a second path:
#
# - the dp dims become the unit's groups: the shard dims (several are flattened into one, as
#   FSDP2 does, e.g. `("dp_shard", "cp")`) are the shard group; the replicate dims (flattened
#   likewise) the replicate group, making it HSDP;
# - the one remaining dim, if any, plays the TP mesh: a parameter's placement there is its
#   TP spec, so its TP-local tensor is sharded on dim 0 across the shard group exactly as in
#   the TP recipe (gather, reduce, padding, checkpoints unchanged);
# - what differs is only the DTensors the user sees. The module computes with the parameter's
#   own spec on the whole mesh (Replicate on the dp dims), and the sharded parameter is a
#   DTensor on the same mesh object with `Shard(0)` (or `_StridedShard` when a later dim also
#   splits dim 0) on the shard dim and the parameter's other placements unchanged; with
#   several shard dims, on the mesh where they are one flattened dim. These are FSDP2's
#   placements and meshes (`_init_sharding_spec_spmd`), so DCP and torch's tools read both
#   engines' parameters alike.
#
# The gradient autograd leaves on the compute face keeps its dp placements (a DTensor loss
# over `Shard(0)` batches makes it `Partial`): its local tensor is what the reduce-scatter sums,
# as in FSDP2; only the tp dim is redistributed to the parameter's placement. More than one
# non-dp dim (EP x TP) is refused: the TP machinery composes with one.


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
