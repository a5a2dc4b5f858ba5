"""FSDP x tensor parallelism: sharding parameters that are already TP DTensors.

[Note: FSDP x TP] The recipe is torchtitan's: `parallelize_module(block, mesh["tp"], plan)`
first, then `fully_shard(block, mesh=mesh["dp"])` per block and on the root. A parameter
that `parallelize_module` made a DTensor on the TP mesh holds, on this rank, its *TP-local*
tensor (a colwise weight: a block of its rows, the output features; a rowwise weight: a
block of its columns). shardwise shards that local tensor on dim 0 across the dp mesh
exactly as it shards a plain parameter ([Note: layout]), so the engine's gather, reduce
and padding code is unchanged:

- all-gather across dp rebuilds the TP-local tensor; the module sees it wrapped as the
  original TP DTensor (same spec), so the TP plan's forward (DTensor weights, redistributed
  inputs/outputs) runs as without FSDP;
- the gradient autograd leaves on that DTensor is brought back to the TP placement (a
  Partial gradient becomes Replicate, as FSDP2 does) and its local tensor is reduce-scattered
  across dp only: TP ranks hold different pieces, or identical copies of a replicated one;
- the sharded parameter the optimizer sees is a DTensor on the (dp, tp) mesh with FSDP2's
  2-D placements: `(Shard(0), Shard(1))` for a rowwise weight, `(_StridedShard(0, tp),
  Shard(0))` for a colwise one (dp splits the TP-local rows, not the global ones), and
  `(Shard(0), Replicate())` for a parameter the plan left replicated.

Parameters of the same units that are *not* TP DTensors (norms, the embedding and head when
the plan leaves them alone) are replicated across tp; in a TP model they still get a DTensor
face on the (dp, tp) mesh, `(Shard(0), Replicate())`, so every parameter lives on one mesh
and PyTorch's `clip_grad_norm_`, optimizers and DCP see one consistent layout.

Sequence parallelism makes a norm weight a Replicate DTensor whose gradient is a TP Partial
sum; `grad_local` reduces it to the TP placement, but only the Megatron plan (no sequence
parallelism) is tested.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..comm import collectives as C
from .dtensor import contiguous_stride

if TYPE_CHECKING:
    from .spmd import SpmdLayout


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
    # fully_shard(dp_mesh_dims=...) ([Note: dp_mesh_dims] in spmd.py): the parameters are
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
        shape = self.global_shape or (1,)  # a 0-d parameter is one row ([Note: layout])
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
