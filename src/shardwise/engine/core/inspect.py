"""Looking inside a sharded model: its units, sharded parameters and per-model context.

The one way the rest of the package (checkpoints, observers, the explorer, the CLI) finds
what the engine built, instead of reading engine attributes off modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .context import ModelContext
    from .mesh import MeshInfo
    from .sharded_param import ShardedParam
    from .unit import Unit


def unit_of(module: nn.Module) -> Unit | None:
    """The unit `fully_shard(module)` made (None: the module was not sharded itself)."""
    # The module's own attribute: a wrapper that forwards unknown attributes to the module
    # inside it (CheckpointWrapper) must not look sharded when only its layer is.
    return vars(module).get("_sw_unit")


def units_of(model: nn.Module) -> list[Unit]:
    """Every unit at or below `model`, in module order (the root, if sharded, first)."""
    return [u for m in model.modules() if (u := unit_of(m)) is not None]


def is_sharded(model: nn.Module) -> bool:
    return any(unit_of(m) is not None for m in model.modules())


def context_of(model: nn.Module) -> ModelContext | None:
    """The per-model context of the sharded root at or below `model` (None: not sharded)."""
    units = units_of(model)
    return units[0].ctx if units else None


def mesh_of(model: nn.Module) -> MeshInfo | None:
    """The process groups the first unit of `model` communicates over."""
    units = units_of(model)
    return units[0].mesh if units else None


def sharded_params(model: nn.Module) -> list[ShardedParam]:
    """Every ShardedParam under `model`, once each, in unit order."""
    out, seen = [], set()
    for u in units_of(model):
        for p in u.params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def named_sharded_params(model: nn.Module) -> list[tuple[str, ShardedParam]]:
    """(FQN relative to `model`, ShardedParam) for every sharded parameter, first name wins.

    Names follow `model.named_parameters()`, so tied parameters appear once.
    """
    out, seen = [], set()
    for mname, m in model.named_modules():
        for pname, t in m._parameters.items():
            sp = getattr(t, "_sw_param", None) if t is not None else None
            if sp is not None and id(sp) not in seen:
                seen.add(id(sp))
                out.append((f"{mname}.{pname}" if mname else pname, sp))
    return out
