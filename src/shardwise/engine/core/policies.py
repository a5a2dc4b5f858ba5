"""The knobs: sharding strategies, mixed precision, CPU offload and wrap policies.

Everything here is a plain value (frozen dataclasses, enums, predicates) validated on
construction, so a bad knob fails before any process group or collective is touched.
"""

from __future__ import annotations

import enum
import inspect
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..comm import collectives as C
from ..comm.transport import Transport, transport_for
from . import dtensor as DT

# --------------------------------------------------------------------------------------------------
# Argument checks shared by the public API: a bad value raises `ValueError` up front.
#
# Every check names the parameter, shows the offending value (`repr`) and says what is
# allowed. They are pure and local (no collectives), so a function calls them first and a
# mistake fails on every rank before any process group is touched. `bool` is refused where
# an int or a number is meant: `True` passing as 1 hides a swapped argument.


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: {allowed}")


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, value, "must be True or False")
    return value


def check_int(name: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, "must be an int" + _range(minimum, maximum))
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _fail(name, value, "must be an int" + _range(minimum, maximum))
    return value


def _range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def check_number(name: str, value: Any, *, positive: bool = False, finite: bool = True,
                 above: float | None = None, below: float | None = None) -> float:
    """A real number (not a bool), finite unless `finite=False` (NaN is never allowed)."""
    bounds = []
    if positive:
        bounds.append("> 0")
    if above is not None:
        bounds.append(f"> {above}")
    if below is not None:
        bounds.append(f"< {below}")
    what = "must be a " + ("finite " if finite else "") + "number" + (
        f" {' and '.join(bounds)}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, value, what)
    v = float(value)
    if math.isnan(v) or (finite and math.isinf(v)):
        raise _fail(name, value, what)
    if (positive and v <= 0) or (above is not None and v <= above) or (
            below is not None and v >= below):
        raise _fail(name, value, what)
    return v


def check_module(name: str, value: Any) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise _fail(name, value if _short(value) else type(value).__name__,
                    "must be a torch.nn.Module")
    return value


def _short(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def check_path(name: str, value: Any) -> str:
    """A non-empty str or os.PathLike, as a str."""
    if not isinstance(value, (str, os.PathLike)):
        raise _fail(name, value, "must be a non-empty str or os.PathLike")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise _fail(name, value, "must be a non-empty str or os.PathLike")
    return path


def check_params(name: str, value: Any) -> list[nn.Parameter]:
    """None or an iterable of nn.Parameter (a single Parameter counts as one)."""
    if value is None:
        return []
    if isinstance(value, nn.Parameter):
        return [value]
    allowed = "must be None or an iterable of torch.nn.Parameter (e.g. module.parameters())"
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(name, value, allowed)
    out = list(value)
    bad = [p for p in out if not isinstance(p, nn.Parameter)]
    if bad:
        raise ValueError(f"{name} holds {bad[0]!r}, which is not allowed: {allowed}")
    return out


def check_shard_placement(module: nn.Module, fn: Any, ignored: Iterable[nn.Parameter]
                          ) -> dict[int, int]:
    """FSDP2's `shard_placement_fn` (param -> Shard(dim) or None), asked for every parameter
    the unit will own: {id(param): dim >= 0} for those it placed (None: the default,
    [Note: balanced shards] in layout.py). A negative dim counts from the end, as in FSDP2;
    any valid dim is allowed, even one the group does not divide (padded like dim 0)."""
    if fn is None:
        return {}
    if not callable(fn):
        raise _fail("shard_placement_fn", fn, "must be None or a callable taking a parameter "
                    "and returning torch's Shard(dim) or None")
    from torch.distributed.tensor import Shard

    skip = {id(p) for p in ignored}
    dims: dict[int, int] = {}
    for name, p in module.named_parameters():
        if id(p) in skip or hasattr(p, "_sw_param"):
            continue  # ignored, or already owned by a sharded child
        got = fn(p)
        if got is None:
            continue
        if type(got) is not Shard:
            raise ValueError(
                f"shard_placement_fn returned {got!r} for parameter {name!r}: it must return "
                "torch's Shard(dim) or None (a parameter on a mesh of its own, FSDP2's "
                "ShardPlacementResult: give its module a fully_shard call with that mesh)")
        nd = max(p.dim(), 1)
        if not -nd <= got.dim < nd:
            raise ValueError(f"shard_placement_fn returned Shard({got.dim}) for parameter "
                             f"{name!r} of shape {tuple(p.shape)}: dim out of range "
                             f"[{-nd}, {nd - 1}]")
        dim = got.dim % nd
        if dim != 0 and (hasattr(p, "fsdp_pre_all_gather") or type(p.data) not in (
                torch.Tensor,)):
            raise NotImplementedError(
                f"shard_placement_fn returned Shard({got.dim}) for parameter {name!r}, a "
                f"{type(p.data).__name__}: tensor subclasses and all-gather extensions are "
                "sharded on dim 0 only; return Shard(0) or None for it")
        dims[id(p)] = dim
    return dims


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
    def parse(cls, value: str | ShardingStrategy | Any) -> ShardingStrategy:
        """Ours, a name, or FSDP1's `torch.distributed.fsdp.ShardingStrategy` (all five
        members; its `_HYBRID_SHARD_ZERO2` is HYBRID_SHARD whose units keep their parameters
        from forward to backward: `reshards_after_forward` tells the two apart)."""
        if isinstance(value, ShardingStrategy):
            return value
        torch_name = _fsdp1_strategy_name(value)
        if torch_name is not None:
            return cls.HYBRID_SHARD if torch_name == _ZERO2 else cls[torch_name]
        if isinstance(value, str):
            key = value.strip().upper().replace("-", "_")
            if key in cls.__members__:
                return cls[key]
        allowed = ", ".join(cls.__members__)
        raise ValueError(f"sharding_strategy={value!r} is not one of: {allowed} (names, "
                         "sw.ShardingStrategy or torch.distributed.fsdp.ShardingStrategy)")

    @classmethod
    def reshards_after_forward(cls, value: str | ShardingStrategy | Any) -> bool:
        """Whether units free their full parameters after forward under `value` (what
        `parse` takes): FULL_SHARD and HYBRID_SHARD do; SHARD_GRAD_OP, NO_SHARD and FSDP1's
        `_HYBRID_SHARD_ZERO2` keep them for backward."""
        if _fsdp1_strategy_name(value) == _ZERO2:
            return False
        return cls.parse(value) in (cls.FULL_SHARD, cls.HYBRID_SHARD)


# FSDP1's hybrid strategy that keeps parameters from forward to backward (ZeRO-2 inside a node).
_ZERO2 = "_HYBRID_SHARD_ZERO2"


# Its name in configs and on the command line (`--shard.sharding_strategy HYBRID_SHARD_ZERO2`;
# FSDP1's own spelling, with the underscore, is taken too).
HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"


def _fsdp1_strategy_name(value: Any) -> str | None:
    """The member name of FSDP1's `torch.distributed.fsdp.ShardingStrategy` (or the name of
    its `_HYBRID_SHARD_ZERO2` as a string), else None."""
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    if isinstance(value, str) and value.strip().upper().replace("-", "_").lstrip("_") == (
            HYBRID_SHARD_ZERO2):
        return _ZERO2
    return value.name if isinstance(value, TorchStrategy) else None


# The strategy names, for configs and CLIs that list the choices.
STRATEGY_NAMES: tuple[str, ...] = tuple(s.value for s in ShardingStrategy)
# What a config's sharding_strategy takes: those and FSDP1's hybrid ZeRO-2 (HYBRID_SHARD whose
# units keep their parameters from forward to backward).
CONFIG_STRATEGY_NAMES: tuple[str, ...] = (*STRATEGY_NAMES, HYBRID_SHARD_ZERO2)

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
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, name, parse_dtype(getattr(self, name), name))
        check_bool("cast_forward_inputs", self.cast_forward_inputs)

    @classmethod
    def from_torch(cls, value: Any, root: bool = False) -> Any:
        """torch.distributed.fsdp.MixedPrecisionPolicy -> ours (same fields, same meaning);
        FSDP1's MixedPrecision -> ours for a unit (`root`: for the root unit; see
        `from_fsdp1`); anything else is returned as it is."""
        from torch.distributed.fsdp import MixedPrecision as TorchMP1
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

        if isinstance(value, TorchMP):
            return cls(value.param_dtype, value.reduce_dtype, value.output_dtype,
                       value.cast_forward_inputs)
        if isinstance(value, TorchMP1):
            return cls.from_fsdp1(value, root)
        return value

    @classmethod
    def from_fsdp1(cls, value: Any, root: bool = False) -> MixedPrecisionPolicy | None:
        """FSDP1's `MixedPrecision` -> the policy of a unit: compute in `param_dtype`, reduce
        in `reduce_dtype` (None: param_dtype, as in FSDP1), no output cast (FSDP1 has none).
        The root unit casts its inputs when `cast_root_forward_inputs`, the others when
        `cast_forward_inputs` (FSDP1's defaults: the root only). `buffer_dtype` is the
        model's, applied by shard_model (`fsdp1_buffer_dtype`). `keep_low_precision_grads`
        is refused: shardwise's gradients are in the sharded parameters' dtype."""
        if value.keep_low_precision_grads is not False and value.param_dtype is not None:
            raise ValueError(
                f"MixedPrecision.keep_low_precision_grads={value.keep_low_precision_grads!r} "
                "is not allowed: shardwise writes gradients in the parameters' own dtype; "
                "use keep_low_precision_grads=False (the default)")
        check_bool("MixedPrecision.cast_forward_inputs", value.cast_forward_inputs)
        check_bool("MixedPrecision.cast_root_forward_inputs", value.cast_root_forward_inputs)
        parse_dtype(value.buffer_dtype, "MixedPrecision.buffer_dtype")
        if value.param_dtype is None and value.reduce_dtype is None:
            return None
        cast = value.cast_root_forward_inputs if root else value.cast_forward_inputs
        return cls(parse_dtype(value.param_dtype, "MixedPrecision.param_dtype"),
                   parse_dtype(value.reduce_dtype, "MixedPrecision.reduce_dtype"), None, cast)

    @classmethod
    def parse(cls, value: str | MixedPrecisionPolicy | None, root: bool = False
              ) -> MixedPrecisionPolicy | None:
        """`root`: the policy of the root unit (differs only for FSDP1's MixedPrecision)."""
        from torch.distributed.fsdp import MixedPrecision as TorchMP1

        if isinstance(value, TorchMP1):
            return cls.from_fsdp1(value, root)
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
            f"mixed_precision={value!r} is not allowed; use None, 'bf16', 'fp16', "
            "sw.MixedPrecisionPolicy(...), torch's MixedPrecisionPolicy or FSDP1's "
            "MixedPrecision"
        )


def fsdp1_buffer_dtype(value: Any) -> torch.dtype | None:
    """FSDP1's `MixedPrecision.buffer_dtype` (None for anything else): the dtype the model's
    floating-point buffers compute in."""
    from torch.distributed.fsdp import MixedPrecision as TorchMP1

    if isinstance(value, TorchMP1):
        return parse_dtype(value.buffer_dtype, "MixedPrecision.buffer_dtype")
    return None


def check_fsdp1_ignored_classes(value: Any, model: nn.Module, policy: object) -> None:
    """FSDP1 with a MixedPrecision and an auto_wrap_policy wraps the modules of
    `MixedPrecision._module_classes_to_ignore` (BatchNorm by default) as their own units
    computing in fp32; shardwise has no such override, so a model that holds one is refused."""
    from torch.distributed.fsdp import MixedPrecision as TorchMP1

    if not isinstance(value, TorchMP1) or policy is None:
        return
    classes = tuple(value._module_classes_to_ignore)
    found = next((type(m).__name__ for m in model.modules() if classes
                  and isinstance(m, classes)), None)
    if found is not None:
        raise ValueError(
            f"MixedPrecision._module_classes_to_ignore={value._module_classes_to_ignore!r} "
            f"matches {found} in the model: FSDP1 runs those modules in fp32 as units of their "
            "own, which shardwise does not; pass _module_classes_to_ignore=() (they then "
            "compute in param_dtype) or mixed_precision=None")


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
        for name in ("params", "pin_memory"):
            check_bool(f"CPUOffloadPolicy.{name}", getattr(self, name))

    @classmethod
    def from_torch(cls, value: Any) -> Any:
        """torch.distributed.fsdp.CPUOffloadPolicy -> ours (parameters, gradients and
        optimizer state on the host, as FSDP2 does); its base OffloadPolicy (no offload) ->
        None; FSDP1's CPUOffload(offload_params=True) -> ours, False -> None; anything else
        is returned as it is."""
        from torch.distributed.fsdp import CPUOffload as TorchOffload1
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
        from torch.distributed.fsdp import OffloadPolicy as TorchNoOffload

        if isinstance(value, TorchOffload1):  # FSDP1's: parameters and gradients on the host
            check_bool("CPUOffload.offload_params", value.offload_params)
            return cls() if value.offload_params else None
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
            f"cpu_offload={value!r} is not allowed; use True, False, sw.CPUOffloadPolicy(...) "
            "or FSDP1's CPUOffload(...)"
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


def resolve_wrap_policy(policy: WrapPolicyLike, model: nn.Module,
                        ignored: set[int] | None = None) -> WrapPolicy | None:
    """Turn the `auto_wrap_policy` argument into a predicate (or None: the root only).

    FSDP1's policies are taken with FSDP1's meaning ([Note: FSDP1 wrap policies]):
    `torch.distributed.fsdp.wrap`'s `ModuleWrapPolicy` / `CustomPolicy`, and any callable
    with FSDP1's `(module, recurse, nonwrapped_numel)` signature (partials of
    `transformer_auto_wrap_policy`, `size_based_auto_wrap_policy`,
    `lambda_auto_wrap_policy`, a user's own). `ignored`: ids of ignored parameters, which
    FSDP1's `nonwrapped_numel` does not count.
    """
    if policy is None:
        return None
    from torch.distributed.fsdp.wrap import _Policy as TorchPolicy

    if isinstance(policy, TorchPolicy) or (callable(policy) and _takes_fsdp1_args(policy)):
        chosen = _fsdp1_targets(policy, model, ignored or set())

        def fsdp1_policy(module: nn.Module) -> bool:
            return id(module) in chosen

        fsdp1_policy.__name__ = f"fsdp1({policy!r})"[:200]
        return fsdp1_policy
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


def _takes_fsdp1_args(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can be called as FSDP1 calls a policy: module=, recurse=,
    nonwrapped_numel= (shardwise's own predicates take the module only)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(module=None, recurse=True, nonwrapped_numel=0)
    except TypeError:
        return False
    return True


def _fsdp1_targets(policy: Any, model: nn.Module, ignored: set[int]) -> set[int]:
    """ids of the modules FSDP1 would wrap under `policy`, the root excluded.

    [Note: FSDP1 wrap policies] A `_Policy` object (ModuleWrapPolicy, CustomPolicy) names
    its targets through `_run_policy`. A callable runs FSDP1's `_recursive_wrap`: asked with
    `recurse=True` whether to look inside a module, then, after its children, with
    `recurse=False` whether to wrap it, `nonwrapped_numel` being its parameters (ignored
    ones not counted) less those its wrapped descendants took; the root is never asked
    the second question (FSDP1 wraps it itself). Modules whose parameters are all ignored
    are FSDP1's ignored modules: skipped, as are their children.
    """
    skip: set[nn.Module] = set()
    for m in model.modules():
        params = list(m.parameters())
        if params and all(id(p) in ignored for p in params):
            skip.update(m.modules())
    from torch.distributed.fsdp.wrap import _Policy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        chosen = policy._run_policy(model, skip, {})
        for m, kwargs in chosen.items():
            if kwargs:
                raise ValueError(
                    f"auto_wrap_policy={policy!r} gives {type(m).__name__} its own arguments "
                    f"{sorted(kwargs)}: shardwise applies one set of knobs to every unit; "
                    "return True instead of a dict")
        return {id(m) for m in chosen if m is not model}
    targets: set[int] = set()

    def visit(m: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in m.parameters() if id(p) not in ignored)
        if not policy(module=m, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in m.children() if child not in skip)
        if not is_root and policy(module=m, recurse=False, nonwrapped_numel=numel - wrapped):
            targets.add(id(m))
            return numel
        return wrapped

    visit(model, True)
    return targets


# --------------------------------------------------------------------------------------------------
# The process groups a unit communicates over, from what the user passed.
#
# `mesh=None` is the whole world; a 1-D DeviceMesh one shard group; a 2-D one (replicate,
# shard) is HYBRID_SHARD. Each mesh chooses its transport once (transport.py).


@dataclass
class MeshInfo:
    """The process groups a unit communicates over."""

    shard_group: ProcessGroup | None
    shard_rank: int
    shard_size: int
    replicate_group: ProcessGroup | None
    replicate_size: int
    device: torch.device
    global_rank: int = 0
    # The DeviceMesh the sharded parameters' DTensors live on (None: they stay plain).
    device_mesh: DeviceMesh | None = None
    # How the shard group moves flat buffers: decided once, when the mesh is made.
    transport: Transport = field(init=False)

    def __post_init__(self) -> None:
        self.transport = (transport_for(self.shard_group) if self.shard_size > 1
                          else Transport(None))

    @property
    def dp_size(self) -> int:
        """Ranks that see different data: gradients are averaged over all of them."""
        return self.shard_size * self.replicate_size


def default_device() -> torch.device:
    if C.is_initialized() and C.backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_info_for(mesh: object | None) -> MeshInfo:
    """MeshInfo from None (the whole world), a 1-D DeviceMesh, or a 2-D one (replicate, shard)."""
    device = default_device()
    grank = C.rank()
    if isinstance(mesh, MeshInfo):
        return mesh
    if mesh is None:
        # A one-rank world has a mesh too (FSDP2's parameters are DTensors there as well:
        # Lightning's ModelParallelStrategy finds a distributed model by them).
        dmesh = DT.world_mesh(device.type) if C.is_initialized() else None
        return MeshInfo(None, C.rank(), C.world_size(), None, 1, device, grank, dmesh)
    ndim = getattr(mesh, "ndim", None)
    if not isinstance(mesh, DeviceMesh):
        ndim = None  # not a DeviceMesh, whatever its ndim says
    else:
        device = _device_of(mesh)
    if ndim == 1:
        g = mesh.get_group()  # type: ignore[attr-defined]
        return MeshInfo(g, C.rank(g), C.world_size(g), None, 1, device, grank, mesh)  # type: ignore[arg-type]
    if ndim == 2:
        rep, shard = mesh.get_group(0), mesh.get_group(1)  # type: ignore[attr-defined]
        return MeshInfo(shard, C.rank(shard), C.world_size(shard), rep, C.world_size(rep),
                        device, grank, mesh)  # type: ignore[arg-type]
    raise ValueError(f"mesh={mesh!r} must be None or a 1-D or 2-D torch DeviceMesh")


def _device_of(mesh: DeviceMesh) -> torch.device:
    """The units' device for `mesh`: a CUDA mesh over gloo (two ranks sharing one GPU, where
    NCCL refuses duplicate devices) puts them on the GPU, as FSDP2 does; else the backend's."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return default_device()


def mesh_for_strategy(strategy: ShardingStrategy, mesh: object | None) -> object | None:
    """What shard_model's `sharding_strategy` makes of `mesh`: a MeshInfo, or the mesh."""
    world = C.world_size()
    if strategy is ShardingStrategy.NO_SHARD:
        if mesh is None:
            return MeshInfo(None, 0, 1, None, world, default_device(), C.rank())
        # The replicas are the mesh's ranks: ignoring it all-reduced over the world, which
        # hung a model on a subgroup ([Note: model ranks] in context.py).
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            raise ValueError(f"NO_SHARD takes mesh=None (every rank) or a 1-D DeviceMesh of "
                             f"the ranks that replicate the model, got {mesh!r}")
        g = mesh.get_group()
        return MeshInfo(None, 0, 1, g, C.world_size(g), _device_of(mesh), C.rank())
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if mesh is not None:
            if getattr(mesh, "ndim", None) != 2:
                raise ValueError(f"HYBRID_SHARD needs a 2-D DeviceMesh (replicate, shard), "
                                 f"got {mesh!r}")
            return mesh
        local = C.env_int("LOCAL_WORLD_SIZE", world)
        if local < 1 or world % local:
            raise ValueError(f"HYBRID_SHARD: LOCAL_WORLD_SIZE={local} does not divide the "
                             f"world size {world}")
        shard_g, rep_g = C.new_groups_2d(world // local, local)
        dev = default_device()
        dmesh = DT.hybrid_mesh(rep_g, shard_g, world // local, local, dev.type)
        return MeshInfo(shard_g, C.rank(shard_g), local, rep_g, world // local, dev,
                        C.rank(), dmesh)
    if mesh is not None and getattr(mesh, "ndim", None) == 2:
        raise ValueError(f"{strategy.value} takes a 1-D mesh; a 2-D mesh means HYBRID_SHARD")
    return mesh


def agreement_groups(units: Iterable[Any]) -> list[ProcessGroup | None]:
    """The groups a model's engine-internal agreements run over ([Note: model group]).

    [Note: model group] The checks that keep a model's ranks in step (the layout check, the
    freeze check, the stale-gathered-parameter decision) must run over the ranks that run
    the model and no others: over the world, a model sharded on a subgroup (a pipeline
    stage's dp mesh, ranks {0, 1} of 3) waited for ranks that never run it, or met another
    model's check there. The ranks are the union of the units' meshes (under TP the (dp, tp)
    mesh; a group of None is the world). When they are the whole world this is [None], one
    all-reduce as before; when one of the units' groups holds exactly them, that group; else
    the groups of the mesh's dims in a fixed order (`collectives.max_over` reduces over each
    in turn, which reaches every rank of a product mesh). [] when no other rank runs it.
    """
    ranks, groups = _span(units)
    if ranks >= set(range(C.world_size())):
        return [None]
    exact = [g for g in groups if set(C.group_ranks(g)) == ranks]
    return exact[:1] or list(groups)


def model_ranks(units: Iterable[Any]) -> list[int]:
    """The global ranks that run the model of `units`, ascending (its first rank first):
    where model-level operations (checkpoints, full state dicts) send from or write on."""
    ranks, _ = _span(units)
    return sorted(ranks | {C.rank()})


def _span(units: Iterable[Any]) -> tuple[set[int], list[ProcessGroup | None]]:
    """(the global ranks of the units' meshes, the distinct groups of their dims); the
    whole world and [None] as soon as one dim's group is the world."""
    ranks: set[int] = set()
    groups: list[ProcessGroup | None] = []
    for u in units:
        m: MeshInfo = u.mesh
        tp = next((p.tp.ctx for p in u.params if p.tp is not None), None)
        dmesh = tp.spmd_mesh if tp is not None else m.device_mesh
        if dmesh is not None:
            ranks.update(int(r) for r in dmesh.mesh.flatten().tolist())
        dims = [(m.replicate_group, m.replicate_size), (m.shard_group, m.shard_size)]
        if tp is not None and tp.tp_mesh is not None:
            dims.append((tp.tp_mesh.get_group(), tp.tp_size))
        for g, n in dims:
            if n <= 1:
                continue
            if g is None:
                return set(range(C.world_size())), [None]  # a group of the whole world
            if dmesh is None:
                ranks.update(C.group_ranks(g))
            if all(g is not h for h in groups):
                groups.append(g)
    return ranks, groups


# [Note: coalesced units] in schedule.py. The default budget: units whose all-gather output
# is this small or smaller share collectives with their neighbours up to this many bytes.
# Chosen by measurement (benchmarks/coalesce.py, benchmarks/RESULTS.md "Issue 43").
DEFAULT_COALESCE_BYTES = 4 << 20


def check_coalesce_bytes(value: object) -> int:
    """fully_shard's `coalesce_bytes`: None (the default budget) or an int >= 0."""
    if value is None:
        return DEFAULT_COALESCE_BYTES
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"coalesce_bytes={value!r} must be None (the default, "
                         f"{DEFAULT_COALESCE_BYTES} bytes) or an int >= 0 (0: each unit "
                         "gathers and reduces alone)")
    return value
