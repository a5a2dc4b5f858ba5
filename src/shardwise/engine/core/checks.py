"""Argument checks shared by the public API: a bad value raises `ValueError` up front.

Every check names the parameter, shows the offending value (`repr`) and says what is
allowed. They are pure and local (no collectives), so a function calls them first and a
mistake fails on every rank before any process group is touched. `bool` is refused where
an int or a number is meant: `True` passing as 1 hides a swapped argument.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


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
