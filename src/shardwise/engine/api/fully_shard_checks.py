"""fully_shard's argument checks: the modules it is given, its policies, and each parameter
it is to shard (plain, a TP DTensor, or a tensor subclass with FSDP2's all-gather hooks).
Each raises naming the offending value (docs/errors.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..core import dtensor as DT
from ..core.checks import check_params
from ..core.extension import is_subclass
from ..core.policies import CPUOffloadPolicy, MixedPrecisionPolicy
from ..core.sharded_param import ParamRef
from ..core.tp import TPContext
from .module_api import check_reshard_after_forward
from .sharded_module import own_unit


def check_modules(module: object) -> list[nn.Module]:
    """What fully_shard was given, as a list of modules none of which is sharded yet."""
    if isinstance(module, (list, tuple)):
        if not module:
            raise ValueError("fully_shard got an empty list of modules")
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard got a list with the same module twice")
        modules = list(module)
    else:
        modules = [module]  # type: ignore[list-item]
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard needs an nn.Module, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard got a {type(m).__name__}, which has no forward of its own, so "
                "its hooks would never run; shard each of its modules instead"
            )
        if own_unit(m) is not None:
            raise ValueError(f"{type(m).__name__} is already sharded")
    return modules


def check_options(modules: list[nn.Module], reshard_after_forward: object, mp_policy: object,
                  offload_policy: object, ignored_params: Iterable[nn.Parameter] | None
                  ) -> tuple[MixedPrecisionPolicy | None, CPUOffloadPolicy | None,
                             list[nn.Parameter]]:
    """fully_shard's policies as shardwise's own (torch's accepted), and the ignored
    parameters as a list."""
    check_reshard_after_forward(reshard_after_forward)
    mp = MixedPrecisionPolicy.from_torch(mp_policy)
    offload = CPUOffloadPolicy.from_torch(offload_policy)
    if mp is not None and not isinstance(mp, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy={mp!r} must be sw.MixedPrecisionPolicy, torch's "
                         "MixedPrecisionPolicy or None")
    if offload is not None and not isinstance(offload, CPUOffloadPolicy):
        raise ValueError(f"offload_policy={offload!r} must be sw.CPUOffloadPolicy, "
                         "torch's CPUOffloadPolicy / OffloadPolicy or None")
    return mp, offload, check_params("ignored_params", ignored_params)


def check_plain_param(ref: ParamRef, t: torch.Tensor, tp: TPContext | None) -> None:
    """A parameter not sharded yet that shardwise can shard: plain, a TP DTensor (with `tp`),
    or a tensor subclass with both of FSDP2's all-gather hooks."""
    if DT.is_dtensor(t) and tp is None:
        raise ValueError(
            f"{ref.fqn} is already a DTensor ({t.placements} on "  # type: ignore[attr-defined]
            f"{t.device_mesh}); shardwise shards plain parameters and TP "  # type: ignore[attr-defined]
            "DTensors from parallelize_module (see docs/parallelism.md)")
    if DT.is_dtensor(t):
        if DT.uses_all_gather_extension(t) or is_subclass(DT.local_of(t)):
            raise NotImplementedError(
                f"{ref.fqn} is a tensor-parallel DTensor over a "
                f"{type(DT.local_of(t)).__name__}: FSDP2's all-gather extensions with tensor "
                "parallelism are not supported; shard it without parallelize_module")
        return
    if not is_subclass(t):
        if DT.uses_all_gather_extension(t):
            # FSDP2 drops them silently (its shard is a new tensor); so would shardwise.
            raise NotImplementedError(
                f"{ref.fqn} carries fsdp_pre_all_gather / fsdp_post_all_gather on the tensor "
                "given to fully_shard, where they do not survive sharding: define them on a "
                "tensor subclass, or patch them onto the shard after sharding "
                f"(model.get_parameter({ref.fqn!r})._local_tensor), as in FSDP2")
        return
    # [Note: all-gather extensions] in engine/core/extension.py.
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    problem = (
        "it does not define FSDP2's all-gather extension (fsdp_pre_all_gather and "
        "fsdp_post_all_gather), so its gather would drop the subclass's own data"
        if not (pre or post) else
        "it defines only one of fsdp_pre_all_gather / fsdp_post_all_gather" if pre != post else
        "it is on the meta device (build extension parameters on a real device)" if t.is_meta
        else "it is 0-d (extension parameters are sharded on dim 0)" if t.dim() == 0
        else "")
    if problem:
        raise NotImplementedError(
            f"{ref.fqn} is a {type(t).__name__} parameter that shardwise cannot shard: "
            f"{problem}")
