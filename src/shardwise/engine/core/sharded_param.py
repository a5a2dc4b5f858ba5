"""One parameter, whole: `ShardedParam` holds its shard and the views between rows and the
module's face, its unsharded storage (allocated between unshard and reshard, filled from the
all-gather output), its gradients (the local one before reduction, the sharded one as rows),
a tensor-subclass shard's all-gather hooks (`Extension`, FSDP2's contract: NF4, float8) and
its materialization (meta -> real, written from a full tensor).

[Note: layout] A parameter of shape (D0, *rest) is padded on dim 0 to S * C rows with
C = ceil(D0 / S) (S = shard-group size) and chunked `torch.chunk`-style: shard-group rank r
owns rows [r*C, min((r+1)*C, D0)). The *sharded* parameter the optimizer sees is exactly
those valid rows (possibly zero of them); it is a view into a padded (C, *rest) buffer so the
all-gather can send fixed-size chunks without copying padding around. The *unsharded*
parameter is a view of the first D0 rows of a padded (S*C, *rest) buffer whose storage
exists only while the unit is unsharded. On the module, the sharded parameter is a DTensor
whose local tensor is `local` (dtensor.py [Note: DTensor parameters]).

[Note: 0-d parameters] A 0-d parameter (FSDP2 refuses them) is one row of one element that
every rank of the shard group holds: `local` is that row on every rank, and the face is a
DTensor of global shape () placed `Replicate()` on every mesh dim (a plain 0-d tensor
without a mesh), so `parameters()`, `state_dict()`, DCP and the optimizer see shape ().
The rows machinery is unchanged: C = 1, each rank sends its copy to the all-gather and the
unsharded parameter is row 0 (shard rank 0's copy). Its gradient is packed into every
rank's row of the reduce buffer (`Unit`'s `pack_grad`), so the reduce-scatter hands each
rank the whole reduced gradient (no extra collective) and the optimizer steps every copy
alike. Readers that count rows across ranks (checkpoints, the gradient norm) take the row
from shard rank 0 only (`owns_rows`). The copies agree bit for bit where the reduction sums
each rank's chunk in the same order (2 ranks; gloo's all-to-all transport); a reduction that
orders the sum per chunk (NCCL's ring at 3 or more ranks) may leave them one rounding apart,
and every gather computes with shard rank 0's, which checkpoints store.

A parameter sharded on another dim d ([Note: balanced shards] in layout.py, or FSDP2's
`shard_placement_fn`) is the same machinery on `movedim(d, 0)`: *rows* are its slices along
d, the shard and the all-gather's send and output buffers hold rows of the moved tensor, and
the DTensor face (`Shard(d)`) is a view moved back. The unsharded parameter is not: as in
FSDP2 it is its own contiguous tensor in the original layout (user code calls `.view()` on
it, and kernels such as `torch._grouped_mm` want the original strides), filled by one
strided copy per parameter from the all-gather output (`layout.rows_into_full`; FSDP2 copies
twice, through a temporary). Only d != 0 pays that copy; a dim-0 unsharded parameter stays a
view of the padded rows buffer the gather writes into. Its gradient, contiguous too, is
packed for the reduce-scatter by the inverse strided copy (`layout.full_into_rows`).
`local`, `padded_shard`, `row_start` / `row_end`, `dim0` and `rest` always speak of rows;
`to_rows` / `from_rows` convert a tensor of the face's layout (a gradient, optimizer state,
a loaded shard) and back.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

from . import dtensor as DT
from .dtensor import TPContext, TPParam, contiguous_stride
from .layout import from_rows, full_into_rows, rows_into_full, to_rows

# FSDP2's all-gather extension contract: shards that decide what their all-gather moves.
#
# [Note: all-gather extensions] A shard (the sharded DTensor's local tensor) that defines
# `fsdp_pre_all_gather` and `fsdp_post_all_gather` (torchao's NF4Tensor for QLoRA, torchao's
# float8 weights, a user's tensor subclass, or the two methods patched onto a plain shard after
# sharding) computes what its parameter's all-gather sends and what the module computes with,
# exactly as FSDP2 calls them:
#
# - pre: `local.fsdp_pre_all_gather(shard_mesh)` (the legacy form) or `(shard_mesh,
#   outer_size, outer_stride, module, mp_policy)` returns `(inputs, metadata)`: one or more
#   tensors of any dtypes (NF4: int8 scalers, a float factor, uint8 codes) and anything
#   else the post hook needs. It sees this rank's valid rows (short or empty on a trailing
#   rank of an uneven split); the 5-argument form must then return inputs of the padded
#   shard's size (FSDP2's rule, checked here), the legacy form equal sizes on every rank.
# - the unit gathers every extension parameter's inputs in one all-gather, rank-major like
#   its plain buckets, as bytes (uint8) when their dtypes differ (and for float8, which
#   gloo cannot move). Each input gets an output
#   of S times its size, made at the first gather; reshard frees their storage (and the
#   inner tensors the post hook named) and the next gather resizes it back.
# - post: the first gather calls `fsdp_post_all_gather(outputs, metadata, param_dtype)`, which
#   returns (the unsharded tensor, inner tensors to free); the unsharded parameter is that
#   tensor at the original shape, made once. Later gathers pass it as `out=` so the subclass
#   refreshes it in place (autograd saved it in forward, as with plain parameters).
#
# `param_dtype` is the unit's mixed-precision dtype for floating parameters (the parameter's
# own dtype otherwise); the pre hook casts, if it wants to. Gradients of an extension
# parameter are plain tensors (FSDP2's as well) and reduce with the unit's plain bucket of
# its compute dtype. Plain parameters of the same unit keep their own buckets and gathers.


def is_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass with its own dispatch (NF4, float8 weights, TwoTensor); a marker
    subclass of Tensor or Parameter without one is a plain tensor to the engine."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__  # type: ignore[comparison-overlap]


def has_hooks(t: torch.Tensor) -> bool:
    return hasattr(t, "fsdp_pre_all_gather") or hasattr(t, "fsdp_post_all_gather")


class Extension:
    """One parameter's side of the contract: its hooks, this gather's inputs, its outputs."""

    def __init__(self, sp: ShardedParam, shard_mesh: DeviceMesh) -> None:
        local = sp.local
        if not (hasattr(local, "fsdp_pre_all_gather") and hasattr(local, "fsdp_post_all_gather")):
            raise ValueError(
                f"{sp.fqn}: a {type(local).__name__} shard defines only one of "
                "fsdp_pre_all_gather / fsdp_post_all_gather; the all-gather extension needs both")
        n = len(inspect.signature(local.fsdp_pre_all_gather).parameters)
        if n not in (1, 5):
            raise ValueError(
                f"{sp.fqn}: fsdp_pre_all_gather{inspect.signature(local.fsdp_pre_all_gather)} "
                "takes (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)")
        self.sp = sp
        self.legacy = n == 1
        # The 1-D mesh of the shard group (HYBRID_SHARD: its shard dim), as FSDP2 passes it.
        self.mesh = shard_mesh
        # This gather's metadata and input sizes (from pre, for post).
        self.metadata: Any = None
        self.sizes: list[torch.Size] = []
        # Flat (S * numel,) outputs, one per input; their storage exists while unsharded.
        self.outputs: list[torch.Tensor] = []
        # What the first post hook said to free at reshard (often the outputs themselves).
        self.inner: list[torch.Tensor] = []
        # Whether the unsharded parameter exists yet (the first post hook makes it).
        self.made = False

    def inputs(self, mp_policy: TorchMP) -> list[torch.Tensor]:
        """Run the pre hook on this rank's shard; its inputs, flat."""
        sp = self.sp
        local = sp.local
        if local.device != sp.device:
            # CPU offload: the hook sees the shard on the compute device, as in FSDP2.
            local = local.to(sp.device, non_blocking=True)
        if self.legacy:
            inputs, self.metadata = local.fsdp_pre_all_gather(self.mesh)
        else:
            inputs, self.metadata = local.fsdp_pre_all_gather(
                self.mesh, sp.orig_shape, contiguous_stride(sp.orig_shape),
                sp.refs[0].module, mp_policy)
            padded = torch.Size((sp.chunk_rows, *sp.rest))
            if local.shape != padded and any(t.shape != padded for t in inputs):
                raise RuntimeError(
                    f"{sp.fqn} (shape {tuple(sp.orig_shape)}) is split unevenly over "
                    f"{sp.shard_size} ranks: fsdp_pre_all_gather must return inputs of the "
                    f"padded shard's size {tuple(padded)}, got {[tuple(t.shape) for t in inputs]}")
        self.sizes = [t.size() for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def outputs_for(self, numels: list[int], dtypes: list[torch.dtype], S: int,
                    device: torch.device) -> list[torch.Tensor]:
        """The flat outputs of this gather, allocated (made at the first, resized after)."""
        if [o.numel() for o in self.outputs] != [n * S for n in numels] or \
                [o.dtype for o in self.outputs] != dtypes:
            self.outputs = [torch.empty(n * S, dtype=dt, device=device)
                            for n, dt in zip(numels, dtypes)]
        for t in self.outputs:
            _alloc(t)
        return self.outputs

    def post(self) -> None:
        """Run the post hook over the gathered outputs: make or refresh the unsharded param."""
        sp = self.sp
        outs = tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs, self.sizes))
        if self.made:
            for t in self.inner:
                _alloc(t)
            sp.local.fsdp_post_all_gather(outs, self.metadata, sp.compute_dtype,
                                          out=sp.unsharded)
        else:
            tensor, inner = sp.local.fsdp_post_all_gather(outs, self.metadata, sp.compute_dtype)
            self.inner = list(inner)
            full = torch.as_strided(tensor, sp.orig_shape, contiguous_stride(sp.orig_shape), 0)
            sp.set_unsharded(nn.Parameter(full, requires_grad=sp.requires_grad))
            self.made = True
        self.metadata = None

    def free(self) -> None:
        for t in (*self.outputs, *self.inner):
            storage = t.untyped_storage()
            if storage.size() != 0:
                storage.resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def shard_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the shard dim (the last one), which the pre hook gets."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[names[-1]]
    return DeviceMesh.from_group(mesh.get_group(mesh.ndim - 1), mesh.device_type)


@dataclass
class ParamRef:
    """Where a module holds the parameter: `module._parameters[name]` (aliases: several)."""

    module: nn.Module
    name: str
    fqn: str


class ShardedParam:
    """One parameter's shard and its views, its unsharded storage, its gradients, a
    subclass shard's all-gather hooks and its materialization ([Note: layout])."""

    # How many times any parameter's tensors were (re)made: the shard, the sharded and
    # unsharded Parameters, the buffers behind them (`_build`, `set_unsharded`). A unit keeps
    # per-layout lists of these tensors for its per-step loops (unit.py's `UnitHot`,
    # `BucketHot`) and remakes them when this moved, so a loop never copies into a buffer a
    # parameter no longer uses. Rare (materialize, a loaded quantized base), so a count over
    # all parameters costs nothing and needs no owner bookkeeping.
    rebuilds = 0

    def __init__(
        self,
        param: nn.Parameter,
        refs: list[ParamRef],
        shard_rank: int,
        shard_size: int,
        device: torch.device,
        compute_dtype: torch.dtype | None,
        host_device: torch.device | None = None,
        pin_memory: bool = False,
        device_mesh: DeviceMesh | None = None,
        tp: TPContext | None = None,
        shard_dim: int = 0,
    ) -> None:
        # Tensor parallelism ([Note: FSDP x TP], dtensor.py): the engine shards the TP-local
        # tensor; `tp` knows the global layout. None: a model without TP.
        self.tp = TPParam(param, tp) if tp is not None else None
        requires_grad = param.requires_grad
        if self.tp is not None:
            param = self.tp.local_param(param)
        # Every place the module tree refers to this parameter; the first names it.
        self.refs = refs
        self.fqn = refs[0].fqn
        self.orig_shape = param.shape
        self.orig_dtype = param.dtype
        self.requires_grad = requires_grad
        self.shard_rank = shard_rank
        self.shard_size = shard_size
        # Compute/communication dtype of the unsharded parameter (mixed precision).
        self.compute_dtype = compute_dtype or param.dtype
        # Where compute happens vs where the shard is stored (differ under CPU offload).
        self.device = device
        self.host_device = host_device or device
        # Page-locked host shards (CPU offload to a GPU): host<->device copies run async.
        self.pin_memory = pin_memory and self.host_device.type == "cpu" and device.type == "cuda"

        # A 0-d parameter: one row that every rank holds, a replicated face
        # ([Note: 0-d parameters]).
        self.scalar = param.dim() == 0
        # How the module presents the shard ([Note: DTensor parameters]); None: plain.
        # The dim whose slices are this parameter's rows (0 for a 0-d parameter).
        self.shard_dim = shard_dim % param.dim() if param.dim() > 0 else 0
        self.spec = (DT.spec_for(device_mesh, self.orig_shape, self.orig_dtype, self.shard_dim)
                     if device_mesh is not None else None)
        if self.tp is not None:
            self.spec = self.tp.sharded_spec(self.orig_dtype)  # on the (dp, tp) mesh

        shape2d = tuple(self.orig_shape) if param.dim() > 0 else (1,)
        shape2d = (shape2d[self.shard_dim], *(n for i, n in enumerate(shape2d)
                                              if i != self.shard_dim))
        self.dim0 = shape2d[0]
        self.rest = shape2d[1:]
        self.row_numel = math.prod(self.rest)
        self.chunk_rows = -(-self.dim0 // shard_size)  # ceil
        self.row_start = 0 if self.scalar else min(shard_rank * self.chunk_rows, self.dim0)
        self.row_end = 1 if self.scalar else min((shard_rank + 1) * self.chunk_rows, self.dim0)
        # Elements of one padded shard: what each rank contributes to an all-gather.
        self.chunk_numel = self.chunk_rows * self.row_numel
        # A tensor subclass with FSDP2's all-gather hooks (NF4, float8 weights): its shard
        # stays that subclass and its hooks decide the gather ([Note: all-gather extensions]).
        self.subclass = is_subclass(param)
        # The hooks' state while the shard carries them (set in _build; refresh_extension).
        self.ext: Extension | None = None
        self._device_mesh = device_mesh

        # The unit this parameter belongs to (set by fully_shard; changes when re-homed).
        # The unit that gathers and reduces this parameter (unit.py's Unit, set by
        # fully_shard; typed loosely because unit.py builds on this file).
        self.owner: Any = None
        # Unsharded gradient accumulated across no_sync() backwards in the reduce dtype, when
        # that differs from the compute dtype (FSDP2 upcasts the same way).
        self.acc_grad: torch.Tensor | None = None
        # Direct parameters keep their gradient in place: (tensor, version) of the one last
        # handed to a reduction, so that an untouched gradient is not reduced twice.
        self._handed: tuple[weakref.ref[torch.Tensor], int] | None = None
        # A direct parameter's post-accumulate-grad hooks, set aside from its gradient's
        # accumulation until the reduced gradient is written (hide_post_accumulate_hooks).
        self._hidden_hooks: dict[Any, Any] = {}
        if self.subclass:
            padded = self._subclass_shard(param)
        else:
            padded = torch.zeros((self.chunk_rows, *self.rest), dtype=self.orig_dtype,
                                 device=self._shard_device(param))
            if not param.is_meta:
                with torch.no_grad():
                    rows = self.local_slice(param.detach())
                    padded[: self.row_end - self.row_start].copy_(rows)
        if self.pin_memory and not param.is_meta:
            padded = padded.pin_memory()
        self._build(padded, meta=param.is_meta)

    def _build(self, padded: torch.Tensor, meta: bool) -> None:
        """Create the sharded and unsharded Parameter objects around `padded`."""
        ShardedParam.rebuilds += 1
        self._padded_shard = padded
        old = getattr(self, "sharded", None)
        if old is not None:
            # Replaced (materialize): an optimizer still holding it must fail loudly.
            old._sw_orig_of = self  # type: ignore[attr-defined]
        # This rank's rows as a plain tensor: what the engine, checkpoints and grad norm use
        # (a subclass parameter's: the subclass, narrowed by its own op as in FSDP2).
        self.local = (padded.narrow(0, 0, self.local_rows) if self.subclass
                      else padded[: self.local_rows])
        # What the module and the optimizer hold: a DTensor over `local` (same storage).
        face = self.from_rows(self.local)
        face = face if self.spec is None else DT.wrap(face, self.spec)
        self.sharded = nn.Parameter(face, requires_grad=self.requires_grad)
        self.sharded._sw_param = self  # type: ignore[attr-defined]
        if self.spec is not None and self.shard_dim == 0 and not self.scalar:
            # The very tensor object inside the DTensor (nn.Parameter detached a new alias
            # of the same storage): FSDP2's recipe patches its hooks onto that object.
            self.local = DT.local_of(self.sharded)
        # Direct: one rank holds everything in the compute dtype on the compute device, so
        # the sharded parameter *is* the unsharded one (NO_SHARD without casts). Not for a
        # 0-d parameter: its gathered row is the unsharded parameter (a copy of one
        # element per step is the price of keeping one code path).
        self.direct = (
            self.shard_size == 1
            and self.compute_dtype == self.orig_dtype
            and self.host_device == self.device
            and len(self.orig_shape) > 0
            # Under TP the module computes with the TP DTensor, not the (dp, tp) shard.
            and self.tp is None
            # A DTensor face (a one-rank mesh): forward computes with a plain tensor.
            and self.spec is None
            and not self.subclass
            # On another dim the face is a moved view; forward needs the original strides.
            and self.shard_dim == 0
        )
        # [Note: one rank's parameters] Whole: one shard of everything in the compute dtype on
        # the compute device, behind a DTensor face (the one-rank mesh of FULL_SHARD and the
        # others). The unsharded parameter is then a plain Parameter over the shard's own
        # storage: nothing to allocate, copy or free per gather, where FSDP2 copies the shard
        # into a fresh buffer and frees it again at each one. A write to the shard (an
        # optimizer step) is in the unsharded parameter at once, as a gather would bring it;
        # the Parameter keeps its own version counter, as a gathered one does.
        self.whole = (
            not self.direct
            and self.shard_size == 1
            and self.compute_dtype == self.orig_dtype
            and self.host_device == self.device
            and len(self.orig_shape) > 0
            and self.tp is None
            and not self.subclass
            and self.shard_dim == 0
            and not meta
        )
        self._build_unsharded(padded, meta)
        self.ext = None
        self.refresh_extension()
        if not self.direct:
            self.free_unsharded()
        for ref in self.refs:
            ref.module._parameters[ref.name] = self.sharded

    def set_requires_grad(self, requires_grad: bool) -> None:
        self.requires_grad = requires_grad
        self.sharded.requires_grad_(requires_grad)
        self.unsharded.requires_grad_(requires_grad)
        if not requires_grad:
            self.acc_grad = None

    # --- this rank's rows, and the face's layout --------------------------------------

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The user's parameter shape (under TP: the global one, not the TP-local one)."""
        return self.tp.global_shape if self.tp is not None else tuple(self.orig_shape)

    def to_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor in the face's layout (this rank's shard, or a full tensor) as rows."""
        return t.reshape(1) if t.dim() == 0 else to_rows(t, self.shard_dim)

    def from_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Rows back in the face's layout (a view; a 0-d parameter's one row as shape ())."""
        return t.view(()) if self.scalar else from_rows(t, self.shard_dim)

    @property
    def owns_rows(self) -> bool:
        """Whether this rank's rows are its own (stored, counted in a norm): all but a 0-d
        parameter's copies off shard rank 0 ([Note: 0-d parameters])."""
        return not self.scalar or self.shard_rank == 0

    def _shard_device(self, param: torch.Tensor) -> torch.device:
        return torch.device("meta") if param.is_meta else self.host_device

    @property
    def local_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def is_meta(self) -> bool:
        return self._padded_shard.is_meta

    @property
    def padded_shard(self) -> torch.Tensor:
        """(C, *rest): this rank's chunk, padding rows (always zero) included."""
        return self._padded_shard

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (original-shape) tensor."""
        return self.to_rows(full)[self.row_start : self.row_end]

    # ---- unsharded storage: allocated, freed, filled from the gather output ----

    def _build_unsharded(self, padded: torch.Tensor, meta: bool) -> None:
        """Create the unsharded Parameter and the storage behind it (freed by the caller)."""
        if self.subclass:
            # The unsharded parameter comes from the first gather's post hook; until then
            # an empty stand-in keeps the flags (requires_grad, .grad = None) meaningful.
            self._full_padded = None
            self.unsharded = nn.Parameter(torch.empty(0, dtype=self.compute_dtype,
                                                      device="meta" if meta else self.device),
                                          requires_grad=self.requires_grad)
        elif self.direct:
            self._full_padded = padded
            self.unsharded = self.sharded
        elif self.whole:
            self._full_padded = padded  # (dim0, *rest): with one shard nothing pads it
            self.unsharded = nn.Parameter(padded.view(self.orig_shape),
                                          requires_grad=self.requires_grad)
            self.unsharded._sw_param = self  # type: ignore[attr-defined]
        else:
            # Dim 0: the padded rows the gather writes into; another dim: the parameter's
            # own contiguous shape, copied into from the gather output ([Note: layout]).
            shape = ((self.shard_size * self.chunk_rows, *self.rest) if self.shard_dim == 0
                     else self.orig_shape)
            full = torch.empty(shape, dtype=self.compute_dtype,
                               device="meta" if meta else self.device)
            self._full_padded = full
            view = full[: self.dim0].view(self.orig_shape) if self.shard_dim == 0 else full
            self.unsharded = nn.Parameter(
                view if self.tp is None else self.tp.compute_face(view),
                requires_grad=self.requires_grad,
            )
            self.unsharded._sw_param = self  # type: ignore[attr-defined]
        # Kept, not remade per gather: views of a tensor follow its storage through
        # `resize_`, and the storage object is the same one each time.
        full = self._full_padded
        self._storage = None if meta or full is None else full.untyped_storage()
        self._nbytes = 0 if full is None else full.numel() * full.element_size()
        # (S, C * row_numel) rank-major rows of the unsharded buffer: dim 0 only.
        self._rows = (None if full is None or self.shard_dim != 0
                      else full.data.view(self.shard_size, self.chunk_numel))

    @property
    def full_padded(self) -> torch.Tensor:
        """The buffer behind the unsharded parameter: (S*C, *rest) padded rows on dim 0,
        the original shape (contiguous, no padding) on another dim ([Note: layout])."""
        return self._full_padded

    def alloc_unsharded(self) -> None:
        """Plain parameters' unsharded storage back (extensions: sharded_param.py does it)."""
        storage = self._storage
        if self.direct or self.whole or storage is None:
            return
        if storage.size() != self._nbytes:
            storage.resize_(self._nbytes)

    def free_unsharded(self) -> None:
        if self.ext is not None:
            self.ext.free()
        storage = self._storage
        if self.direct or self.whole or storage is None:
            return  # (whole: the shard's own storage)
        if storage.size() != 0:
            storage.resize_(0)

    def unsharded_rows_view(self) -> torch.Tensor | None:
        """(S, C * row_numel) view of the unsharded buffer (row r is rank r's chunk) for a
        dim-0 parameter; None on another dim (`copy_out` / `rows_into` copy instead)."""
        assert self._full_padded is not None, "a subclass parameter has no unsharded buffer"
        return self._rows

    def copy_out(self, rows: torch.Tensor, non_blocking: bool = False) -> None:
        """Write gathered rank-major `rows` ((S, C * row_numel)) into the unsharded
        parameter (`.data`: no autograd version bump, see Unit.wait_unshard)."""
        if self._rows is not None:
            self._rows.copy_(rows, non_blocking=non_blocking)
        else:
            rows_into_full(rows, self._full_padded.data, self.shard_dim, self.chunk_rows,
                           non_blocking)

    def rows_into(self, dst: torch.Tensor, first_rank: int) -> None:
        """Copy ranks `first_rank ..`'s rows of the unsharded parameter into `dst`
        ((R, C * row_numel), padding rows zero as the gather had them): what hpZ keeps."""
        if self._rows is not None:
            dst.copy_(self._rows[first_rank: first_rank + dst.shape[0]])
        else:
            full_into_rows(self._full_padded.data, dst, self.shard_dim, self.chunk_rows,
                           first_rank)

    def gathered_local_rows(self) -> torch.Tensor:
        """The rows this rank sent to the last gather, shaped like `local` (a view of the
        unsharded buffer; a 0-d parameter's copy is its own row of it, not row 0)."""
        start = self.shard_rank if self.scalar else self.row_start
        return to_rows(self._full_padded.data, self.shard_dim)[start: start + self.local_rows]

    # ---- gradients: the local one before reduction, the sharded one as rows ----

    def _direct_grad_is_new(self, g: torch.Tensor | None) -> bool:
        h = self._handed
        return g is not None and not (h is not None and h[0]() is g and g._version == h[1])

    def has_local_grad(self) -> bool:
        """Whether `local_grad()` would return a gradient, without folding or moving any."""
        if self.direct:
            return self._direct_grad_is_new(self.sharded.grad)
        return self.unsharded.grad is not None or self.acc_grad is not None

    def local_grad(self) -> torch.Tensor | None:
        """This rank's full-shape gradient not yet handed to a reduction (None if none);
        direct, the whole gradient it holds.

        Not a predicate: gradients accumulated under no_sync are folded into `acc_grad`
        here (see `has_local_grad` for the question alone).
        """
        if self.direct:
            # All of it, even unchanged since the last reduction: that reduction replaced
            # the gradient with the mean on every rank, so what a rank accumulated since is
            # on top of it (a rank that did not use the parameter again still holds its
            # share). Sending zeros instead lost it (NO_SHARD without zero_grad, or a unit
            # reduced twice in one backward).
            return self.sharded.grad
        g = self.unsharded_grad()
        if self.acc_grad is None:
            return g
        if g is not None:
            with torch.no_grad():
                self.acc_grad.add_(g)
            self.unsharded.grad = None
        return self.acc_grad

    def unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded parameter's gradient as a plain tensor (TP: its local part)."""
        g = self.unsharded.grad
        if g is None or self.tp is None:
            return g
        return self.tp.grad_local(g)

    def drop_local_grad(self) -> None:
        """The local gradient was packed for reduction: free it (direct: remember it)."""
        if self.direct:
            self.mark_reduced()
        else:
            self.unsharded.grad = None
            self.acc_grad = None

    def mark_reduced(self) -> None:
        g = self.sharded.grad
        # A weak reference: the reduced gradient is the user's to free (zero_grad); holding it
        # here kept last step's gradient alive until the next reduction (NO_SHARD).
        self._handed = (weakref.ref(g), g._version) if g is not None else None

    @property
    def shard_grad(self) -> torch.Tensor | None:
        """This rank's rows of the sharded gradient (a plain tensor, a view), or None."""
        g = self.sharded.grad
        return None if g is None else self.to_rows(DT.local_of(g))

    def set_shard_grad(self, rows: torch.Tensor) -> None:
        """Make `rows` (plain, shaped like `local`) the sharded gradient."""
        face = self.from_rows(rows)
        if self.spec is None:
            self.sharded.grad = face
            return
        # The parameter's own spec object (equal to `self.spec`): DTensor caches sharding
        # propagation per spec, so a gradient with an equal but distinct spec pays a hash
        # and a comparison in every optimizer op between the two (SGD's add_ took twice as
        # long, issue 43).
        self.sharded.grad = DT.wrap(face, getattr(self.sharded, "_spec", self.spec))

    # ---- post-accumulate-grad hooks ([Note: post-accumulate-grad hooks] in unit.py) ----

    def post_accumulate_hooks(self) -> dict[Any, Any]:
        """The hooks registered on the sharded parameter (`register_post_accumulate_grad_hook`),
        those set aside while a direct parameter's local gradient accumulates included."""
        return self._hidden_hooks or getattr(self.sharded, "_post_accumulate_grad_hooks",
                                             None) or {}

    def hide_post_accumulate_hooks(self) -> None:
        """A direct parameter is what autograd accumulates into, so autograd would run its
        hooks on the local, unreduced gradient: set them aside until the reduced one is
        written (`run_post_accumulate_hooks`). The dict stays the tensor's own (autograd
        holds it; a handle's remove() still finds it), emptied meanwhile."""
        hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
        if hooks:
            self._hidden_hooks.update(hooks)
            hooks.clear()

    def run_post_accumulate_hooks(self) -> None:
        """The reduced sharded gradient is written: run the hooks on the sharded parameter,
        as FSDP2 does (a direct parameter's only when set aside: otherwise autograd ran them
        on a gradient that needed no reduction)."""
        if self.direct:
            if not self._hidden_hooks:
                return
            hooks = self.sharded._post_accumulate_grad_hooks
            hooks.update(self._hidden_hooks)
            self._hidden_hooks.clear()
        else:
            hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
            if not hooks:
                return
        for hook in list(hooks.values()):
            hook(self.sharded)

    # ---- tensor-subclass shards (NF4, float8) and their all-gather hooks ----

    def _subclass_shard(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's padded chunk of a subclass parameter, made by the subclass's own ops
        (FSDP2's: new_zeros of the padded size, this rank's torch.chunk copied into its
        first rows), so it stays the subclass with this rank's share of the inner data."""
        data = param.detach()
        chunks = torch.chunk(data, self.shard_size, dim=0)
        with torch.no_grad():
            padded = data.new_zeros((self.chunk_rows, *self.rest))
            if self.local_rows > 0:
                padded.narrow(0, 0, self.local_rows).copy_(chunks[self.shard_rank])
        if self.host_device != padded.device:
            padded = padded.to(self.host_device)
        return padded

    def refresh_extension(self) -> bool:
        """Take up FSDP2's all-gather hooks on the shard (a subclass's, or patched onto it
        after sharding, FSDP2's monkey-patch recipe); True when that changed."""
        hooked = has_hooks(DT.local_of(self.sharded))
        if hooked == (self.ext is not None):
            return False
        if not hooked:
            self.ext = None
            return True
        if self.shard_dim != 0:
            raise NotImplementedError(
                f"{self.fqn}: FSDP2's all-gather extension (fsdp_pre_all_gather) on a "
                f"parameter sharded on dim {self.shard_dim}: shardwise runs extensions on "
                "dim-0 shards only; shard it with Shard(0)")
        if self.direct or self._device_mesh is None:
            raise NotImplementedError(
                f"{self.fqn}: FSDP2's all-gather extension (fsdp_pre_all_gather) runs on "
                "parameters sharded on a DeviceMesh; NO_SHARD (sharding_strategy) has none: "
                "use fully_shard or FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD")
        self.ext = Extension(self, shard_mesh_of(self._device_mesh))
        return True

    def set_unsharded(self, param: nn.Parameter) -> None:
        """The unsharded parameter an extension's first post hook made."""
        ShardedParam.rebuilds += 1
        param._sw_param = self
        self.unsharded = param

    def adopt_subclass_shard(self, padded: torch.Tensor) -> None:
        """Replace this rank's shard (meta or plain) with `padded`, a tensor subclass with
        FSDP2's all-gather hooks and the padded shard's shape: a frozen base quantized as it
        loads (checkpoint/quantize.py). New Parameter objects, as in `materialize`; the
        owner unit must rebuild its layout (`Unit.set_params`) before the next gather."""
        assert tuple(padded.shape) == (self.chunk_rows, *self.rest) and is_subclass(padded)
        self.subclass = True
        self._build(padded, meta=False)

    # ---- materialization: meta -> real storage, written from a full tensor ----

    def new_padded_shard(self, *, zero_valid_rows: bool = True) -> torch.Tensor:
        """A (C, *rest) chunk for this rank, where the real shard will live: padding rows
        zero, the valid rows too unless the caller writes all of them (`zero_valid_rows=
        False`: zeroing first would touch every page twice, most of a large load's time)."""
        shape = (self.chunk_rows, *self.rest)
        if zero_valid_rows:
            return torch.zeros(shape, dtype=self.orig_dtype, device=self.host_device)
        padded = torch.empty(shape, dtype=self.orig_dtype, device=self.host_device)
        padded[self.local_rows :].zero_()
        return padded

    def materialize(self, padded: torch.Tensor | None = None) -> None:
        """Allocate this rank's shard for a meta parameter: zeros, or `padded` (made by
        `new_padded_shard` and filled, its padding rows zero) when given.

        New Parameter objects replace the meta ones on every module that refers to this
        parameter (a meta tensor's storage cannot be swapped in place), so build the
        optimizer after materializing.
        """
        if not self.is_meta:
            return
        if padded is None:
            padded = self.new_padded_shard()
        if self.pin_memory:
            padded = padded.pin_memory()
        self._build(padded, meta=False)

    def set_full(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full tensor `full` into the shard."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(
                f"{self.fqn}: got shape {tuple(full.shape)}, expected {self.global_shape}"
            )
        if self.tp is not None:
            full = self.tp.local_piece(full)
        self.materialize()
        with torch.no_grad():
            self.local.copy_(self.local_slice(full))
