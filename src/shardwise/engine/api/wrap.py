"""Which modules become units, and which parameters each unit owns.

Shared by `shard_model` (to shard) and the planner (to predict without allocating), so the
two can never disagree about units or padding.

Ownership rule: a parameter belongs to the deepest unit whose subtree contains every module
that refers to it. So a tied embedding used by the first and last layers lands in their
common ancestor (usually the root), and a unit never reads a parameter it does not own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.policies import WrapPolicy

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def wrap_targets(model: nn.Module, policy: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """Modules the policy selects, children before parents, the root excluded."""
    if policy is None:
        return []
    out: list[tuple[str, nn.Module]] = []
    claimed: set[int] = set()  # ids of parameters owned by a selected descendant
    min_params = getattr(policy, "min_num_params", None)

    def visit(name: str, m: nn.Module, seen: set[int]) -> None:
        for child_name, child in m.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            visit(f"{name}.{child_name}" if name else child_name, child, seen)
        if m is model or isinstance(m, _CONTAINERS):
            return  # containers never run forward, so their hooks would never fire
        if min_params is not None:
            unclaimed = [p for p in m.parameters() if id(p) not in claimed]
            selected = policy(m, sum(p.numel() for p in unclaimed))  # type: ignore[call-arg]
        else:
            selected = bool(policy(m))
        if selected:
            out.append((name, m))
            claimed.update(id(p) for p in m.parameters())

    visit("", model, {id(model)})
    return out


@dataclass(frozen=True)
class ParamSpec:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class UnitSpec:
    """A unit as the planner sees it: its module's FQN ("" = root) and its parameters."""

    name: str
    params: tuple[ParamSpec, ...]
    # id() of each parameter object, in `params` order: what shard_model shards per unit.
    ids: tuple[int, ...] = field(default=(), compare=False, repr=False)


def assign_params(
    model: nn.Module, targets: list[tuple[str, nn.Module]], ignored: set[int] | None = None
) -> list[UnitSpec]:
    """Apply the ownership rule to `targets` + the root, without touching any tensor."""
    ignored = ignored or set()
    unit_names = [name for name, _ in targets] + [""]
    unit_ids = {id(m): name for name, m in targets}
    unit_ids[id(model)] = ""

    # The unit that immediately contains each module, and each unit's parent unit.
    owner_of: dict[int, str] = {}
    parent: dict[str, str | None] = {"": None}

    def visit(m: nn.Module, current: str) -> None:
        for child in m.children():
            if id(child) in owner_of:
                continue
            if id(child) in unit_ids:
                parent[unit_ids[id(child)]] = current
                owner_of[id(child)] = unit_ids[id(child)]
                visit(child, unit_ids[id(child)])
            else:
                owner_of[id(child)] = current
                visit(child, current)

    owner_of[id(model)] = ""
    visit(model, "")

    def ancestors(u: str) -> list[str]:
        chain = [u]
        while parent.get(chain[-1]) is not None:
            chain.append(parent[chain[-1]])  # type: ignore[arg-type]
        return chain

    refs: dict[int, tuple[nn.Parameter, str, set[str]]] = {}
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            entry = refs.setdefault(id(p), (p, fqn, set()))
            entry[2].add(owner_of[id(m)])

    owned: dict[str, list[tuple[ParamSpec, int]]] = {name: [] for name in unit_names}
    for p, fqn, users in refs.values():
        chains = [ancestors(u) for u in users]
        common = [u for u in chains[0] if all(u in c for c in chains[1:])]
        spec = ParamSpec(fqn, tuple(p.shape), p.dtype, p.requires_grad)
        owned[common[0]].append((spec, id(p)))
    return [UnitSpec(name, tuple(s for s, _ in owned[name]), tuple(i for _, i in owned[name]))
            for name in unit_names]
