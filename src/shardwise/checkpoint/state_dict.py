"""Full (unsharded) state dicts with the original module's keys."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..engine.api.fully_shard import reshard_between_steps
from ..engine.comm import collectives as C
from ..engine.core.context import model_group
from ..engine.core.policies import check_bool, check_module
from ..engine.core.sharded_param import ShardedParam
from .slots import refuse_extension, set_plain
from .sync import agreed


def _sp(t: torch.Tensor) -> ShardedParam | None:
    return getattr(t, "_sw_param", None)


def gather_full(sp: ShardedParam) -> torch.Tensor:
    """The full tensor of one sharded parameter, on its compute device, original dtype."""
    if sp.is_meta:
        raise RuntimeError(f"{sp.fqn} is still on the meta device; call sw.materialize first")
    refuse_extension(sp, sp.fqn)
    mesh = sp.owner.mesh  # type: ignore[attr-defined]
    shard = sp.padded_shard.to(mesh.device)
    if sp.shard_size == 1:
        full = shard.clone()
    else:
        full = torch.empty((sp.shard_size * sp.chunk_rows, *sp.rest), dtype=shard.dtype,
                           device=mesh.device)
        C.all_gather(full.view(-1), shard.reshape(-1), mesh.shard_group, async_op=False)
    # Rows of the moved tensor for a shard dim other than 0: back in the parameter's order.
    full = sp.from_rows(full[: sp.dim0]).reshape(sp.orig_shape).contiguous()
    # Under TP that is the TP-local tensor: join the TP pieces (a collective over tp).
    return sp.tp.full_tensor(full) if sp.tp is not None else full


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Original FQNs -> full CPU tensors (parameters and buffers).

    Every rank of the model must call it (it all-gathers one tensor at a time). With
    `rank0_only`, only the model's first rank keeps the tensors: global rank 0 when the
    model runs on every rank, the lowest of its ranks when it is sharded on a subgroup
    (ranks {1, 2} of 3: rank 1); the others get an empty dict and hold no full tensors
    beyond the one in flight. Ranks that do not run the model do not take part.
    """
    check_module("model", model)
    check_bool("rank0_only", rank0_only)
    keep = not rank0_only or model_group(model).is_first
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        sp = _sp(t)
        if sp is None:
            value = t.detach().cpu().clone()
        elif id(sp) in done:
            value = done[id(sp)]  # a tied parameter: same tensor under both keys
        else:
            refuse_extension(sp, key)  # named by its key in the model, on every rank
            value = gather_full(sp).cpu()
            done[id(sp)] = value
        if keep:
            out[key] = value
    return out


def _check(model_sd: Mapping[str, torch.Tensor], sd: Mapping[str, torch.Tensor],
           strict: bool) -> str | None:
    if not isinstance(sd, Mapping):
        return (f"sd={type(sd).__name__} is not allowed: must be a mapping of key -> "
                "torch.Tensor (a state dict)")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        return (f"sd[{bad[0]!r}]={type(sd[bad[0]]).__name__} is not allowed: state dict "
                "values must be torch.Tensor")
    missing = [k for k in model_sd if k not in sd]
    unexpected = [k for k in sd if k not in model_sd]
    if strict and (missing or unexpected):
        return (f"state dict does not match the model: missing keys {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                f"{'...' if len(unexpected) > 5 else ''}")
    for k, t in model_sd.items():
        if k not in sd:
            continue
        sp = _sp(t)
        shape = sp.global_shape if sp else tuple(t.shape)
        if tuple(sd[k].shape) != shape:
            return f"{k}: state dict has shape {tuple(sd[k].shape)}, the model has {shape}"
    return None


def load_full_state_dict(
    model: nn.Module,
    sd: Mapping[str, torch.Tensor] | None,
    from_rank0: bool = False,
    strict: bool = True,
) -> None:
    """Load full tensors into a sharded model; each rank keeps only its rows.

    Works on a model still on the meta device (its shards are allocated here). With
    `from_rank0`, only the model's first rank needs `sd` (global rank 0 when the model runs
    on every rank; on a subgroup, the lowest of its ranks, as `full_state_dict(rank0_only=
    True)` returns it there); tensors are broadcast from it over the model's ranks, one at a
    time. Every rank of the model must call it, no other rank. The state dict is checked
    (keys, shapes) before any tensor moves, and a failure raises on every rank of the model.
    """
    check_module("model", model)
    check_bool("from_rank0", from_rank0)
    check_bool("strict", strict)
    reshard_between_steps(model, "load_full_state_dict")
    model_sd = model.state_dict(keep_vars=True)
    group = model_group(model)
    checker = not from_rank0 or group.is_first
    # Raised on every rank with the failing rank's message, before any tensor moves.
    with agreed(group=group):
        if checker:
            who = (f"{group.describe()}, which must provide it with from_rank0=True"
                   if from_rank0 else f"rank {C.rank()} (every rank must provide it "
                   "unless from_rank0=True)")
            err = (f"load_full_state_dict got sd=None on {who}" if sd is None
                   else _check(model_sd, sd, strict))
            if err:
                raise ValueError(err)
    broadcast = from_rank0 and group.size > 1
    device = torch.device("cpu")
    if broadcast:
        if C.backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # Which keys the first rank has (all of them when strict): one small broadcast.
        present = torch.tensor([sd is not None and k in sd for k in model_sd] if checker
                               else [False] * len(model_sd), dtype=torch.uint8, device=device)
        group.broadcast(present)
        has = [bool(x) for x in present.tolist()]
    else:
        has = [sd is not None and k in sd for k in model_sd]
    # A tied parameter takes the value of its last key that the state dict holds, as
    # nn.Module.load_state_dict (which copies every key in turn) leaves it on the unsharded
    # model; the earlier keys are neither broadcast nor copied.
    last = {id(_sp(t)): k for (k, t), h in zip(model_sd.items(), has)
            if h and _sp(t) is not None}
    for i, (key, t) in enumerate(model_sd.items()):
        sp = _sp(t)
        if not has[i] or (sp is not None and last[id(sp)] != key):
            continue
        if broadcast:
            shape = sp.global_shape if sp else tuple(t.shape)
            dtype = sp.orig_dtype if sp else t.dtype
            buf = sd[key].to(device, dtype) if checker else torch.empty(
                shape, dtype=dtype, device=device)
            full = group.broadcast(buf.contiguous())
        else:
            full = sd[key]
        if sp is not None:
            sp.set_full(full.to(sp.orig_dtype))
        else:
            set_plain(model, key, t, full)
