"""Groups of sibling units that data may skip, and where their rounds end ([Note: lockstep]).

A *group* is the units that are direct children of one `nn.ModuleList` or `nn.ModuleDict`
(the experts of a mixture-of-experts layer, each sharded as its own unit), when the module
holding that container is not itself a unit. A rank whose routing sends no token to expert 3
never calls it; the schedule (schedule.py) visits it in container order instead, so every
rank gathers and reduces every member at the same point.

Containers held directly by a unit (the root's `blocks`, whose order a model may change
from step to step) are left alone: their members are expected to run on every rank.

Containers nested in a container belong to the outer one's group, in container order. A
group's *holder* is the module holding its container (the MoE block). Its forward delimits
the group's rounds: one begins when it starts and ends when it returns, so a block called
twice in one forward makes two rounds on every rank, and a rank that calls none of the
members (all its tokens went elsewhere) still visits them all, when the holder returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from torch import nn

U = TypeVar("U")


@dataclass
class Groups(Generic[U]):
    # Members of each group, in container order.
    members: list[list[U]] = field(default_factory=list)
    # id(unit) -> (group, index in it).
    member_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    # id(unit) -> the groups whose container holds the unit (itself a member, or below one).
    inside: dict[int, frozenset[int]] = field(default_factory=dict)
    # id(unit) -> the groups whose container lies inside the unit's module: they end when
    # the unit's forward ends.
    closes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Each holder (never a unit) with its groups: hooked by engine/hooks.py.
    holders: list[tuple[nn.Module, tuple[int, ...]]] = field(default_factory=list)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _collect(c: nn.Module, unit_at: dict[int, U], members: list[U]) -> None:
    """The units in container `c`, in container order, through nested containers (experts
    split into lists inside a dict run as one sequence)."""
    for m in c.children():
        u = unit_at.get(id(m))
        if u is not None:
            if all(u is not x for x in members):
                members.append(u)
        elif isinstance(m, _CONTAINERS):
            _collect(m, unit_at, members)


def find_groups(tops: list[nn.Module], units: list[U],
                modules_of: dict[int, list[nn.Module]]) -> Groups[U]:
    """The groups of `units` (all under the modules `tops`); `modules_of[id(unit)]` is the
    unit's module (several for FSDP2's list form)."""
    unit_at = {id(m): u for u in units for m in modules_of[id(u)]}
    groups: Groups[U] = Groups()
    containers: list[nn.Module] = []
    held: dict[int, tuple[nn.Module, list[int]]] = {}
    for top in tops:
        named = dict(top.named_modules())
        for name, c in named.items():
            if not isinstance(c, _CONTAINERS) or not name:
                continue
            holder = named[name.rpartition(".")[0]]
            if id(holder) in unit_at or isinstance(holder, _CONTAINERS):
                continue  # (a container inside a container is part of the outer one's group)
            members: list[U] = []
            _collect(c, unit_at, members)
            if not members:
                continue
            # One member is a group too: a rank whose tokens all went to other experts (plain
            # modules of the holder's unit) skips it, and must still gather it.
            g = len(groups.members)
            groups.members.append(members)
            containers.append(c)
            held.setdefault(id(holder), (holder, []))[1].append(g)
            for k, u in enumerate(members):
                groups.member_of[id(u)] = (g, k)
    below = [{id(m) for m in c.modules()} for c in containers]
    for u in units:
        mine = modules_of[id(u)]
        groups.inside[id(u)] = frozenset(g for g, ids in enumerate(below)
                                         if any(id(m) in ids for m in mine))
        inner = {id(x) for m in mine for x in m.modules()}
        groups.closes[id(u)] = tuple(g for g, c in enumerate(containers) if id(c) in inner)
    groups.holders = [(module, tuple(gs)) for module, gs in held.values()]
    return groups
