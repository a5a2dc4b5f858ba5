"""FSDP2's all-gather extension contract: shards that decide what their all-gather moves.

[Note: all-gather extensions] A shard (the sharded DTensor's local tensor) that defines
`fsdp_pre_all_gather` and `fsdp_post_all_gather` (torchao's NF4Tensor for QLoRA, torchao's
float8 weights, a user's tensor subclass, or the two methods patched onto a plain shard after
sharding) computes what its parameter's all-gather sends and what the module computes with,
exactly as FSDP2 calls them:

- pre: `local.fsdp_pre_all_gather(shard_mesh)` (the legacy form) or `(shard_mesh,
  outer_size, outer_stride, module, mp_policy)` returns `(inputs, metadata)`: one or more
  tensors of any dtypes (NF4: int8 scalers, a float factor, uint8 codes) and anything
  else the post hook needs. It sees this rank's valid rows (short or empty on a trailing
  rank of an uneven split); the 5-argument form must then return inputs of the padded
  shard's size (FSDP2's rule, checked here), the legacy form equal sizes on every rank.
- the unit gathers every extension parameter's inputs in one all-gather, rank-major like
  its plain buckets, as bytes (uint8) when their dtypes differ (and for float8, which
  gloo cannot move). Each input gets an output
  of S times its size, made at the first gather; reshard frees their storage (and the
  inner tensors the post hook named) and the next gather resizes it back.
- post: the first gather calls `fsdp_post_all_gather(outputs, metadata, param_dtype)`, which
  returns (the unsharded tensor, inner tensors to free); the unsharded parameter is that
  tensor at the original shape, made once. Later gathers pass it as `out=` so the subclass
  refreshes it in place (autograd saved it in forward, as with plain parameters).

`param_dtype` is the unit's mixed-precision dtype for floating parameters (the parameter's
own dtype otherwise); the pre hook casts, if it wants to. Gradients of an extension
parameter are plain tensors (FSDP2's as well) and reduce with the unit's plain bucket of
its compute dtype. Plain parameters of the same unit keep their own buckets and gathers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

from ..comm.work import Work
from .dtensor import contiguous_stride

if TYPE_CHECKING:
    from .sharded_param import ShardedParam
    from .unit import Unit


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

    def inputs(self, unit: Unit) -> list[torch.Tensor]:
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
                sp.refs[0].module, torch_mp(unit))
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


def torch_mp(unit: Unit) -> TorchMP:
    """The unit's mixed precision as FSDP2's class (what a 5-argument pre hook receives)."""
    mp = unit.mp
    if mp is None:
        return TorchMP()
    return TorchMP(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                   output_dtype=mp.output_dtype, cast_forward_inputs=mp.cast_forward_inputs)


def shard_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the shard dim (the last one), which the pre hook gets."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[names[-1]]
    return DeviceMesh.from_group(mesh.get_group(mesh.ndim - 1), mesh.device_type)


@dataclass
class ExtGather:
    """A unit's extension all-gather in flight: every extension parameter's inputs packed."""

    params: list[ShardedParam]
    numels: list[list[int]]  # per parameter, per input: elements in the input's dtype
    dtypes: list[list[torch.dtype]]
    split: list[int]  # per input: elements in the packed dtype (one rank's row)
    send: torch.Tensor  # pooled (given back once waited for); the output itself when S == 1
    out: torch.Tensor
    work: Work
    start: float
    blocked: float = 0.0
    done: Any = None  # CUDA: an event after the all-gather ([Note: streams])
    pooled: bool = True  # False when S == 1: send and out are one fresh tensor


def pack(unit: Unit, params: list[ShardedParam]) -> tuple[torch.Tensor, ExtGather]:
    """Run the pre hooks, copy every input into one send buffer (bytes when dtypes differ).

    Returns (the send row, the gather without its work) for the caller to issue.
    """
    with torch.no_grad():  # as FSDP2 calls them: what the hooks compute is not autograd's
        per = [p.ext.inputs(unit) for p in params]  # type: ignore[union-attr]
    dtypes = [[t.dtype for t in ts] for ts in per]
    numels = [[t.numel() for t in ts] for ts in per]
    flat = [t for ts in per for t in ts]
    dtype = flat[0].dtype
    if len({t.dtype for t in flat}) > 1 or (dtype.is_floating_point and dtype.itemsize == 1):
        # Mixed dtypes as bytes (FSDP2's rule); float8 too, which gloo cannot move (an
        # all-gather copies bits, so bytes are the same gather).
        dtype = torch.uint8
        flat = [t.contiguous().view(torch.uint8) for t in flat]
    split = [t.numel() for t in flat]
    numel = sum(split)
    S, device = unit.mesh.shard_size, unit.mesh.device
    if S == 1:
        send = out = torch.empty(numel, dtype=dtype, device=device)
        pooled = False
    else:
        out = unit.pool.get(numel * S, dtype, device)
        send = unit.transport.gather_buffer(numel, dtype, device, unit.pool)
        pooled = True
    with torch.no_grad():
        torch.cat(flat, out=send[:numel])
    pg = ExtGather(list(params), numels, dtypes, split, send, out, Work(None, out), 0.0,
                   pooled=pooled)
    return send, pg


def unpack(unit: Unit, pg: ExtGather) -> None:
    """The gathered rows into each parameter's outputs, then its post hook."""
    S = unit.mesh.shard_size
    views: list[torch.Tensor] = []
    for p, numels, dtypes in zip(pg.params, pg.numels, pg.dtypes):
        for o in p.ext.outputs_for(numels, dtypes, S, unit.mesh.device):  # type: ignore[union-attr]
            v = o.view(S, -1)
            views.append(v.view(torch.uint8) if pg.out.dtype is torch.uint8 else v)
    rows = pg.out.view(S, -1)
    # The outputs may be what autograd saved in forward (a post hook that returns them):
    # refilling them in backward must not bump the version it checks (FSDP2 does the same).
    live = tuple(v for v in views if not v.is_inference())
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(live):
        torch.split_with_sizes_copy(rows, pg.split, dim=1, out=views)
    for p in pg.params:
        p.ext.post()  # type: ignore[union-attr]
