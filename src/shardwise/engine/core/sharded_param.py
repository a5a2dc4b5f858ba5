"""One parameter: its shard and the views between rows and the module's face; its unsharded
storage (param_unsharded.py), gradients (param_grads.py), tensor-subclass shards
(param_subclass.py) and materialization (param_materialize.py) are mixins of the same class.

[Note: layout] A parameter of shape (D0, *rest) is padded on dim 0 to S * C rows with
C = ceil(D0 / S) (S = shard-group size) and chunked `torch.chunk`-style: shard-group rank r
owns rows [r*C, min((r+1)*C, D0)). The *sharded* parameter the optimizer sees is exactly
those valid rows (possibly zero of them); it is a view into a padded (C, *rest) buffer so the
all-gather can send fixed-size chunks without copying padding around. A 0-d parameter is
treated as shape (1,). The *unsharded* parameter is a view of the first D0 rows of a padded
(S*C, *rest) buffer whose storage exists only while the unit is unsharded. On the module,
the sharded parameter is a DTensor whose local tensor is `local` (dtensor.py
[Note: DTensor parameters]).

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

import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import dtensor as DT
from .extension import Extension, is_subclass
from .layout import from_rows, to_rows
from .param_grads import ParamGrads
from .param_materialize import Materialize
from .param_subclass import SubclassShard
from .param_unsharded import UnshardedStorage
from .tp import TPContext, TPParam

if TYPE_CHECKING:
    from .unit import Unit


@dataclass
class ParamRef:
    """Where a module holds the parameter: `module._parameters[name]` (aliases: several)."""

    module: nn.Module
    name: str
    fqn: str


class ShardedParam(UnshardedStorage, ParamGrads, SubclassShard, Materialize):
    """One parameter's shard and its views (this file); its unsharded storage
    (param_unsharded.py), gradients (param_grads.py), subclass shards (param_subclass.py)
    and materialization (param_materialize.py) are mixins, one responsibility each."""

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
        # Tensor parallelism ([Note: FSDP x TP], tp.py): the engine shards the TP-local
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

        # How the module presents the shard ([Note: DTensor parameters]); None: plain.
        # A 0-d parameter is one row held by shard rank 0 ([Note: layout]); its face is that
        # row as a DTensor of global shape (1,), so torch's tools see the value once, on
        # the rank that has it (plain, the other ranks' empty rows read as copies of it:
        # DCP saved the parameter empty).
        # The dim whose slices are this parameter's rows (0 for a 0-d parameter).
        self.shard_dim = shard_dim % param.dim() if param.dim() > 0 else 0
        self.spec = (DT.spec_for(device_mesh, self.orig_shape if param.dim() > 0
                                 else torch.Size([1]), self.orig_dtype, self.shard_dim)
                     if device_mesh is not None and (param.dim() > 0 or self.tp is None)
                     else None)
        if self.tp is not None:
            # On the (dp, tp) mesh; a 0-d parameter as (1,) here too (a plain face under TP
            # read as whole on every rank: the empty rows were taken for the value).
            self.spec = self.tp.sharded_spec(self.orig_dtype)

        shape2d = tuple(self.orig_shape) if param.dim() > 0 else (1,)
        shape2d = (shape2d[self.shard_dim], *(n for i, n in enumerate(shape2d)
                                              if i != self.shard_dim))
        self.dim0 = shape2d[0]
        self.rest = shape2d[1:]
        self.row_numel = math.prod(self.rest)
        self.chunk_rows = -(-self.dim0 // shard_size)  # ceil
        self.row_start = min(shard_rank * self.chunk_rows, self.dim0)
        self.row_end = min((shard_rank + 1) * self.chunk_rows, self.dim0)
        # Elements of one padded shard: what each rank contributes to an all-gather.
        self.chunk_numel = self.chunk_rows * self.row_numel
        # A tensor subclass with FSDP2's all-gather hooks (NF4, float8 weights): its shard
        # stays that subclass and its hooks decide the gather ([Note: all-gather extensions]).
        self.subclass = is_subclass(param)
        # The hooks' state while the shard carries them (set in _build; refresh_extension).
        self.ext: Extension | None = None
        self._device_mesh = device_mesh

        # The unit this parameter belongs to (set by fully_shard; changes when re-homed).
        self.owner: Unit | None = None
        # Unsharded gradient accumulated across no_sync() backwards in the reduce dtype, when
        # that differs from the compute dtype (FSDP2 upcasts the same way).
        self.acc_grad: torch.Tensor | None = None
        # Direct parameters keep their gradient in place: (tensor, version) of the one last
        # handed to a reduction, so that an untouched gradient is not reduced twice.
        self._handed: tuple[weakref.ref[torch.Tensor], int] | None = None
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
        if self.spec is not None and self.shard_dim == 0:
            # The very tensor object inside the DTensor (nn.Parameter detached a new alias
            # of the same storage): FSDP2's recipe patches its hooks onto that object.
            self.local = DT.local_of(self.sharded)
        # Direct: one rank holds everything in the compute dtype on the compute device, so
        # the sharded parameter *is* the unsharded one (NO_SHARD without casts). Not for a
        # 0-d parameter: its shard is shaped (1,), and forward must see shape () (a copy of
        # one element per step is the price).
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
        return to_rows(t, self.shard_dim)

    def from_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Rows back in the face's layout (a view)."""
        return from_rows(t, self.shard_dim)

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
        if full.dim() == 0:
            full = full.reshape(1)
        return self.to_rows(full)[self.row_start : self.row_end]
