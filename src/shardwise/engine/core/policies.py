"""The knobs: sharding strategies, mixed precision, CPU offload and wrap policies.

Everything here is a plain value (frozen dataclasses, enums, predicates) validated on
construction, so a bad knob fails before any process group or collective is touched.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from .checks import check_bool, check_int


class ShardingStrategy(str, enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks.

    FULL_SHARD is ZeRO-3 (reshard after forward); SHARD_GRAD_OP keeps the unsharded
    parameters from forward to backward (ZeRO-2-like memory, one all-gather fewer);
    NO_SHARD is DDP (replicated parameters, all-reduced gradients); HYBRID_SHARD shards
    inside a node and replicates across nodes.
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"

    @classmethod
    def parse(cls, value: str | ShardingStrategy) -> ShardingStrategy:
        if isinstance(value, ShardingStrategy):
            return value
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"sharding_strategy={value!r} is not one of: {allowed}")


# The strategy names, for configs and CLIs that list the choices.
STRATEGY_NAMES: tuple[str, ...] = tuple(s.value for s in ShardingStrategy)

# The one dtype vocabulary: short names in configs, plans and logs.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
}
# What a dtype knob accepts: the short name or torch's own, for the three training dtypes.
_DTYPES = {name: dt for dt in (torch.float32, torch.bfloat16, torch.float16)
           for name in (DTYPE_NAMES[dt], str(dt).removeprefix("torch."))}


def dtype_name(dt: torch.dtype | None) -> str:
    """`torch.bfloat16` -> "bf16"; a dtype without a short name keeps torch's ("int8")."""
    return DTYPE_NAMES.get(dt, str(dt).removeprefix("torch."))


def parse_dtype(value: str | torch.dtype | None, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value is not None and not value.is_floating_point:
            raise ValueError(f"{what}={value} must be a floating-point dtype")
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"{what}={value!r} is not a dtype; use one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; sharded (master) parameters keep their own.

    param_dtype: dtype units all-gather and compute in (None: the parameters' own).
    reduce_dtype: dtype of gradient reduce-scatter / all-reduce (None: param_dtype).
    output_dtype: dtype the root's floating-point outputs are cast to (None: leave them).
    cast_forward_inputs: cast each unit's floating-point inputs to param_dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, field, parse_dtype(getattr(self, field), field))
        check_bool("cast_forward_inputs", self.cast_forward_inputs)

    @classmethod
    def from_torch(cls, value: Any) -> Any:
        """torch.distributed.fsdp.MixedPrecisionPolicy -> ours (same fields, same meaning);
        anything else is returned as it is."""
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

        if isinstance(value, TorchMP):
            return cls(value.param_dtype, value.reduce_dtype, value.output_dtype,
                       value.cast_forward_inputs)
        return value

    @classmethod
    def parse(cls, value: str | MixedPrecisionPolicy | None) -> MixedPrecisionPolicy | None:
        value = cls.from_torch(value)
        if value is None or isinstance(value, MixedPrecisionPolicy):
            return value
        if isinstance(value, str):
            key = value.lower()
            if key in ("fp32", "float32", "none", "no"):
                return None
            if key in ("bf16", "bfloat16"):
                # bf16 has fp32's range, but its 8-bit mantissa loses small gradient
                # contributions when N of them are summed: reduce in fp32.
                return cls(torch.bfloat16, torch.float32, None)
            if key in ("fp16", "float16"):
                return cls(torch.float16, torch.float32, None)
        raise ValueError(
            f"mixed_precision={value!r} is not allowed; use None, 'bf16', 'fp16' "
            "or sw.MixedPrecisionPolicy(...)"
        )


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Keep sharded state in host memory; move it to the compute device per unit.

    params: sharded parameters live on the CPU. Their gradients are written there after
        the reduction, and the optimizer state, created where the parameters live, follows:
        so parameters, gradients and optimizer state move together, as in FSDP2.
    pin_memory: page-lock host buffers so device copies can run asynchronously.
    """

    params: bool = True
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for field in ("params", "pin_memory"):
            check_bool(f"CPUOffloadPolicy.{field}", getattr(self, field))

    @classmethod
    def from_torch(cls, value: Any) -> Any:
        """torch.distributed.fsdp.CPUOffloadPolicy -> ours (parameters, gradients and
        optimizer state on the host, as FSDP2 does); its base OffloadPolicy (no offload) ->
        None; anything else is returned as it is."""
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
        from torch.distributed.fsdp import OffloadPolicy as TorchNoOffload

        if isinstance(value, TorchOffload):
            return cls(pin_memory=value.pin_memory)
        if isinstance(value, TorchNoOffload):
            return None
        return value

    @classmethod
    def parse(cls, value: bool | CPUOffloadPolicy | None) -> CPUOffloadPolicy | None:
        value = cls.from_torch(value)
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, CPUOffloadPolicy):
            return value
        raise ValueError(
            f"cpu_offload={value!r} is not allowed; use True, False or sw.CPUOffloadPolicy(...)"
        )


WrapPolicy = Callable[[nn.Module], bool]
WrapPolicyLike = Union[str, WrapPolicy, None]


def size_policy(min_num_params: int = 100_000) -> WrapPolicy:
    """Wrap every module whose own subtree holds at least `min_num_params` parameters.

    Applied bottom-up, so parameters already claimed by a wrapped child do not count
    towards the parent's size.
    """
    check_int("min_num_params", min_num_params, minimum=1)

    def policy(module: nn.Module, _unclaimed: int | None = None) -> bool:
        n = _unclaimed if _unclaimed is not None else sum(p.numel() for p in module.parameters())
        return n >= min_num_params

    policy.min_num_params = min_num_params  # type: ignore[attr-defined]
    policy.__name__ = f"size_policy({min_num_params})"
    return policy


def transformer_policy(block_classes: Iterable[type[nn.Module]]) -> WrapPolicy:
    """Wrap every instance of the given block classes (transformer layers, say)."""
    if isinstance(block_classes, type) or not isinstance(block_classes, Iterable) \
            or isinstance(block_classes, str):
        raise ValueError(f"block_classes={block_classes!r} is not allowed: must be an iterable "
                         "of nn.Module subclasses, e.g. {Block}")
    classes = tuple(block_classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if not classes or bad:
        what = f"{bad[0]!r}" if bad else "nothing"
        raise ValueError(f"transformer_policy needs nn.Module classes (block_classes), got "
                         f"{what.splitlines()[0]}")

    def policy(module: nn.Module) -> bool:
        return isinstance(module, classes)

    policy.block_classes = classes  # type: ignore[attr-defined]
    policy.__name__ = f"transformer_policy({', '.join(c.__name__ for c in classes)})"
    return policy


def find_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes to wrap for `auto_wrap_policy="transformer"`.

    A model that declares `_no_split_modules` (the Hugging Face convention) names them by
    class name; otherwise, classes repeated inside an `nn.ModuleList` are the blocks.
    """
    names = getattr(model, "_no_split_modules", None)
    if names:
        found = {type(m) for m in model.modules() if type(m).__name__ in set(names)}
        if found:
            return found
    found = set()
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            counts: dict[type[nn.Module], int] = {}
            for child in m:
                counts[type(child)] = counts.get(type(child), 0) + 1
            found.update(cls for cls, n in counts.items() if n > 1)
    return found


def resolve_wrap_policy(policy: WrapPolicyLike, model: nn.Module) -> WrapPolicy | None:
    """Turn the `auto_wrap_policy` argument into a predicate (or None: the root only)."""
    if policy is None:
        return None
    if isinstance(policy, str):
        key = policy.lower()
        if key == "transformer":
            classes = find_block_classes(model)
            if not classes:
                raise ValueError(
                    f"auto_wrap_policy='transformer' found no block classes in "
                    f"{type(model).__name__}: it has no `_no_split_modules` and no class "
                    "repeated in an nn.ModuleList; pass sw.transformer_policy({Block}) instead"
                )
            return transformer_policy(classes)
        if key == "size":
            return size_policy()
        if key in ("none", "root"):
            return None
        raise ValueError(
            f"auto_wrap_policy={policy!r} is not allowed; use 'transformer', 'size', None, "
            "sw.size_policy(n), sw.transformer_policy({Block}) or a callable (module) -> bool"
        )
    if callable(policy):
        return policy
    raise ValueError(f"auto_wrap_policy={policy!r} must be a string, a callable or None")
