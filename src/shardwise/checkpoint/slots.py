"""What one rank holds of each stored tensor: the rows, and whether it writes them.

A *slot* is one tensor of the checkpoint as seen from this rank: the global shape and dtype,
the rows [start, end) of the 2-D row view (see [Note: checkpoint format]) that this rank
holds, and `writes`, true on exactly one rank per row. Sharded parameters (and optimizer
state shaped like them) are held by their shard owners and written by replica 0 of the
replicate group (HYBRID_SHARD and NO_SHARD keep identical copies elsewhere). Everything
else (buffers, ignored parameters) is replicated: every rank holds all rows and global
the model's first rank writes them (global rank 0 when the model runs on every rank;
[Note: model ranks] in engine/core/context.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.comm import collectives as C
from ..engine.core.context import model_group, named_sharded_params
from ..engine.core.dtensor import local_of
from ..engine.core.layout import from_rows
from ..engine.core.sharded_param import ShardedParam
from .manifest import TensorInfo, model_name


@dataclass
class Slot:
    name: str  # the manifest's tensor name
    shape: tuple[int, ...]  # global (original) shape
    dtype: torch.dtype
    start: int  # this rank's rows, [start, end) of the row view
    end: int
    writes: bool
    local: torch.Tensor  # this rank's rows, (end - start, *rest): slices along `dim`
    dim: int = 0  # the dim the rows slice ([Note: checkpoint format])


def writes_shards(sp: ShardedParam) -> bool:
    """Whether this rank writes sp's rows: the first replica does, the others hold copies."""
    mesh = sp.owner.mesh  # type: ignore[attr-defined]
    return mesh.replicate_size == 1 or C.rank(mesh.replicate_group) == 0


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """The (D0, *rest) row view of a full tensor (a 0-d tensor is one row)."""
    return t.reshape(1) if t.dim() == 0 else t


def sharded_slot(name: str, sp: ShardedParam, local: torch.Tensor) -> Slot:
    """`local` is shaped like sp.sharded (the parameter or its optimizer state, a DTensor
    or plain): this rank's shard of a tensor shaped like sp, stored as sp's rows."""
    rows = sp.to_rows(local_of(local.detach())).contiguous()  # a view back to rows: no copy
    start, end = stored_rows(sp)
    # A 0-d parameter's row is every rank's: shard rank 0 writes it ([Note: 0-d parameters]).
    writes = writes_shards(sp) and sp.owns_rows
    if sp.tp is None:
        return Slot(name, tuple(sp.orig_shape), rows.dtype, start, end, writes, rows,
                    sp.shard_dim)
    # TP ([Note: FSDP x TP]): stored as global rows; a rowwise weight's columns are joined
    # across tp (a collective over tp, in the same order on every rank) and TP rank 0 writes.
    rows = sp.tp.checkpoint_local(rows)
    return Slot(name, sp.global_shape, rows.dtype, start, end, writes and sp.tp.writes(), rows)


def stored_rows(sp: ShardedParam) -> tuple[int, int]:
    """The rows of the stored (global) tensor that hold this rank's shard."""
    if sp.tp is None:
        return sp.row_start, sp.row_end
    return sp.tp.checkpoint_rows(sp.row_start, sp.row_end)


def owned_block(sp: ShardedParam) -> tuple[slice, ...]:
    """This rank's block of the stored (global) tensor, one slice per dim (a 0-d tensor is
    one row): `stored_rows(sp)`, and under TP the columns of a weight TP splits past dim 0.

    Exactly the elements of `sp.local`, in the face's layout (`sp.from_rows(sp.local)`):
    what a rank reads of a full tensor. Sharded on dim d != 0: its rows on d, all of dim 0.
    """
    start, end = stored_rows(sp)
    block = [slice(start, end), *(slice(0, n) for n in sp.global_shape[1:])]
    if sp.shard_dim:
        block[0] = slice(0, sp.global_shape[0])
        block[sp.shard_dim] = slice(start, end)
    if sp.tp is not None and sp.tp.shard_dim not in (None, 0):
        d = sp.tp.shard_dim
        block[d] = slice(sp.tp.offset, sp.tp.offset + sp.orig_shape[d])
    return tuple(block)


def read_rows(read: Callable[[str, int, int], torch.Tensor], name: str, info: TensorInfo,
              sp: ShardedParam | None) -> torch.Tensor:
    """What this rank loads of stored tensor `name`: sp's rows (as `sp.local` holds them),
    or, for a plain tensor (sp None), the whole tensor in its own shape.

    Stored on the dim the rank shards it on: only its rows are read. Stored on another
    ([Note: checkpoint format]: saved at another world size, whose balanced dim differed, or
    with another shard_placement_fn): read whole, moved back, and sliced.
    """
    if sp is not None and info.dim == sp.shard_dim:
        return own_rows(sp, read(name, *stored_rows(sp)))
    whole = from_rows(read(name, 0, info.dim0), info.dim).reshape(info.shape)
    if sp is None:
        return whole
    if sp.tp is not None:
        whole = sp.tp.local_piece(whole)
    return sp.local_slice(whole).contiguous()


def own_rows(sp: ShardedParam, rows: torch.Tensor) -> torch.Tensor:
    """This rank's shard from the stored rows `stored_rows(sp)` (TP: its columns of them)."""
    return rows if sp.tp is None else sp.tp.from_rows(rows)


def full_slot(name: str, t: torch.Tensor, writes: bool) -> Slot:
    """A replicated tensor: every rank holds all rows; `writes` on the model's first rank."""
    rows = rows_of(t.detach())
    return Slot(name, tuple(t.shape), t.dtype, 0, rows.shape[0], writes, rows)


@dataclass
class ModelEntry:
    key: str  # state-dict key
    sp: ShardedParam | None  # None: a buffer or an unsharded (ignored) parameter
    tensor: torch.Tensor  # what the module holds now
    writes_full: bool = True  # this rank writes replicated tensors: the model's first rank

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sp.global_shape if self.sp is not None else tuple(self.tensor.shape)

    def slot(self) -> Slot:
        if self.sp is not None:
            return sharded_slot(model_name(self.key), self.sp, self.sp.sharded)
        return full_slot(model_name(self.key), self.tensor, self.writes_full)


@dataclass
class ModelView:
    entries: list[ModelEntry]  # one per stored tensor (tied parameters once)
    keys: list[str]  # every state-dict key, aliases included, in order
    aliases: dict[str, str]  # tied key -> stored key
    # id(parameter object the optimizer holds) -> (fqn, its ShardedParam or None)
    params: dict[int, tuple[str, ShardedParam | None]]
    writes_full: bool = True  # this rank writes replicated tensors: the model's first rank


def refuse_extension(sp: ShardedParam, key: str) -> None:
    """shardwise's own checkpoints and full state dicts move plain tensors: a subclass
    shard (NF4, float8 weights; [Note: all-gather extensions]) is refused by name."""
    if sp.subclass:
        raise NotImplementedError(
            f"{key} is a {type(sp.local).__name__} parameter (FSDP2's all-gather extension): "
            "shardwise's full state dicts, checkpoints and exports hold plain tensors; save "
            "it with model.state_dict() or torch.distributed.checkpoint (its values are "
            "DTensors over the subclass shards), or save only the adapters with "
            "save_checkpoint(..., trainable_only=True)")


def model_view(model: nn.Module, trainable_only: bool = False) -> ModelView:
    """The model's state-dict keys mapped to sharded parameters, tied keys to their first.
    `trainable_only`: only parameters that require grad (a LoRA run's adapters)."""
    canonical = {id(sp): fqn for fqn, sp in named_sharded_params(model)}
    first = model_group(model).is_first
    entries: list[ModelEntry] = []
    keys: list[str] = []
    aliases: dict[str, str] = {}
    first_plain: dict[int, str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if trainable_only and not t.requires_grad:
            continue
        keys.append(key)
        sp = getattr(t, "_sw_param", None)
        if sp is not None:
            if sp.subclass:
                refuse_extension(sp, key)
            fqn = canonical.get(id(sp), key)
            if fqn != key:
                aliases[key] = fqn
            else:
                entries.append(ModelEntry(key, sp, sp.sharded))
            continue
        if id(t) in first_plain:
            aliases[key] = first_plain[id(t)]
            continue
        first_plain[id(t)] = key
        entries.append(ModelEntry(key, None, t, first))
    params: dict[int, tuple[str, ShardedParam | None]] = {
        id(sp.sharded): (fqn, sp) for fqn, sp in named_sharded_params(model)}
    for name, p in model.named_parameters():
        if getattr(p, "_sw_param", None) is None:
            params.setdefault(id(p), (name, None))
    return ModelView(entries, keys, aliases, params, first)


def set_plain(model: nn.Module, key: str, t: torch.Tensor, value: torch.Tensor,
              device: torch.device | None = None) -> None:
    """Write a buffer or an unsharded (ignored) parameter `t` (`model`'s `key`): copy in
    place, or replace a meta-device one with a real tensor (on `device`, else `value`'s)."""
    with torch.no_grad():
        if not t.is_meta:
            t.copy_(value)
            return
    mod_name, _, name = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    real = value.detach().to(device=device or value.device, dtype=t.dtype, copy=True)
    if name in mod._buffers:
        mod._buffers[name] = real
    else:
        mod._parameters[name] = nn.Parameter(real, requires_grad=t.requires_grad)
