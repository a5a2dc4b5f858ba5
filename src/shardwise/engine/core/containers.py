"""Containers of units: every member runs once per call of the module that holds them.

[Note: data-dependent units] Each rank's collectives follow from the module structure alone
([Note: structure decides] in schedule.py): a unit gathers when its forward reaches it. A
model whose data decides which units run breaks that. The usual case is a mixture-of-experts
layer whose experts are sharded one unit each, in an `nn.ModuleList`: a rank that routes no
token to expert 3 never calls it, so it never joins the all-gather the other ranks issue for
it. Their collectives then pair with other ones: same-sized experts exchange each other's
rows (wrong numbers), others abort in the backend or hang.

No per-step agreement between ranks is paid to follow such models (FSDP2 pays none either).
Instead, each rank checks its own calls, which needs no communication: the module holding a
`ModuleList`/`ModuleDict` of units (the *holder*: the MoE layer, the model's layer stack)
must call each member exactly once per call of its own, in any order. A member called a
second time is refused at its forward, before it gathers; a member skipped is named when
the holder returns, before this rank issues another collective. Either way this rank raises
a `RuntimeError` naming the unit and the fix, and its peers, left waiting in a collective it
will not join, get a `CollectiveError` once it exits (or at the collective timeout). The
numbers never go wrong silently.

What keeps every rank's collectives alike whatever the routing: one unit per MoE layer (its
experts plain modules inside it; an expert without tokens gets no gradient, and the reduce
buffer's flags keep that `None`, [Note: unused gradients] in reduce.py), or experts held as
one 3-D parameter (torchtitan's grouped experts). docs/moe.md shows both.

Layer stacks whose order changes between steps, or a holder called several times in one
forward, are fine: only "once per holder call" is checked. Calls made while recomputing
(activation checkpointing) are not counted: the forward already was. Under SHARDWISE_DEBUG the
check stands aside: the collective fingerprints then name the first collective where the
ranks part, on every rank (CollectiveMismatchError), which is the better error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..comm import process_group as PG
from ..comm.debug import debug_enabled

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class ContainerCheck:
    """One model's holders, their member units, and the calls seen in each holder's call."""

    def __init__(self, holders: list[tuple[nn.Module, str, list[tuple[nn.Module, str]]]],
                 in_backward: Callable[[], bool]) -> None:
        # (holder module, its name in the model, its members: (a unit's module, its name)).
        # Modules, not units: a list-form unit may span several members.
        self.holders = holders
        self.in_backward = in_backward
        # id(member module) -> index of its holder; per holder: the members called in its
        # running call (None: the holder is not running).
        self.holder_of = {id(m): i for i, (_, _, ms) in enumerate(holders) for m, _ in ms}
        self.seen: list[set[int] | None] = [None] * len(holders)
        self.handles: list[Any] = []
        for i, (holder, _, _) in enumerate(holders):
            self.handles.append(holder.register_forward_pre_hook(
                functools.partial(self._holder_starts, i)))
            self.handles.append(holder.register_forward_hook(
                functools.partial(self._holder_ends, i)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _holder_starts(self, i: int, module: nn.Module, args: Any) -> None:
        if not self.in_backward() and not debug_enabled():
            self.seen[i] = set()

    def called(self, module: nn.Module) -> None:
        """A unit's `module` begins its forward (outside recomputation): refuse a second
        call in its holder's running call before anything is gathered for it."""
        i = self.holder_of.get(id(module))
        if i is None or self.seen[i] is None:
            return  # not a member, or called outside its holder's forward
        seen = self.seen[i]
        assert seen is not None
        if id(module) in seen:
            self.seen[i] = None
            name = next(n for m, n in self.holders[i][2] if m is module)
            raise RuntimeError(_message(name, self.holders[i][1], "ran twice"))
        seen.add(id(module))

    def _holder_ends(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        seen, self.seen[i] = self.seen[i], None
        if seen is None:
            return
        missing = [n for m, n in self.holders[i][2] if id(m) not in seen]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise RuntimeError(_message(missing[0] + more, self.holders[i][1], "did not run"))


def _message(unit: str, holder: str, what: str) -> str:
    # This rank is out of step with its peers from here on: any further collective would
    # pair with another one, so the exit must not wait for them at a barrier either.
    PG.mark_failed()
    return (f"rank {PG.rank(None)}: unit {unit!r} {what} in this call of {holder or '<root>'!r}, "
            "which holds it in a ModuleList/ModuleDict of units; every rank must run each "
            "such unit once per call, or ranks would issue different collectives (an expert "
            "that got no token here). Shard the MoE layer as one unit (fully_shard on the "
            "layer, not on each expert) or hold the experts as one 3-D parameter; see "
            "docs/moe.md")


def find_holders(named: list[tuple[str, nn.Module]], is_unit: Callable[[nn.Module], bool]
                 ) -> list[tuple[nn.Module, str, list[tuple[nn.Module, str]]]]:
    """The holders among the model's `named` modules (those whose child is a container of
    units; nested containers belong to the outermost one) with their members."""
    by_name = dict(named)
    out = []
    for name, c in named:
        if not name or not isinstance(c, _CONTAINERS):
            continue
        holder_name = name.rpartition(".")[0]
        holder = by_name.get(holder_name)
        if holder is None or isinstance(holder, _CONTAINERS):
            continue  # part of the outer container's members
        members: list[tuple[nn.Module, str]] = []
        _collect(c, name, is_unit, members)
        if members:
            out.append((holder, holder_name, members))
    return out


def _collect(c: nn.Module, prefix: str, is_unit: Callable[[nn.Module], bool],
             members: list[tuple[nn.Module, str]]) -> None:
    for n, m in c.named_children():
        if is_unit(m):
            members.append((m, f"{prefix}.{n}"))
        elif isinstance(m, _CONTAINERS):
            _collect(m, f"{prefix}.{n}", is_unit, members)
