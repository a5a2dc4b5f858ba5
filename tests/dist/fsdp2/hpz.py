"""What the ported reshard_after_forward=2 (hpZ) cases share: the group size of every
all-gather, and a wrapper that runs an existing scenario and checks that hpZ really ran.

At 4 ranks, k=2 keeps each unit sharded over a block of 2 ranks after forward, so backward
gathers within that block ([Note: hpZ] in engine/core/unit.py). Upstream's k=2 cases in the
autograd, frozen and mixed-precision files compare values only; the wrapper adds one check
that they could not pass as plain `True` (which would gather over all 4 ranks in backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from tests.dist.fsdp2.common import Expect

K = 2  # the hpZ block every ported case uses (upstream's value), at 4 ranks


class Gather(NamedTuple):
    label: str  # the unit's label ("<root>" for the root)
    group: int  # ranks the all-gather ran over
    backward: bool  # issued while autograd ran a backward


@contextlib.contextmanager
def record_gathers() -> Iterator[list[Gather]]:
    """Record each all-gather a unit issues through its transport, with its group size."""
    from shardwise.engine.comm import transport as T

    log: list[Gather] = []
    owners = (T.Transport, T.AllToAllTransport)
    saved = [(owner, owner.__dict__["all_gather"]) for owner in owners]

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def all_gather(self: Any, *args: Any, **kwargs: Any) -> Any:
            # -1 outside a backward: autograd's engine runs no graph task then.
            in_backward = torch._C._current_graph_task_id() != -1
            log.append(Gather(kwargs.get("label", ""), self.size, in_backward))
            return orig(self, *args, **kwargs)
        return all_gather

    for owner, orig in saved:
        owner.all_gather = wrap(orig)  # type: ignore[method-assign]
    try:
        yield log
    finally:
        for owner, orig in saved:
            owner.all_gather = orig  # type: ignore[method-assign]


def check_blocks(ex: Expect, log: list[Gather], world: int, what: str,
                 all_in_blocks: bool) -> None:
    """Forward gathers over the whole shard group; backward's within K-rank blocks (all of
    them when `all_in_blocks`; else at least one: a unit whose last forward ran under
    no_grad, or that a later forward gathered again, holds no block rows)."""
    fwd = sorted({g.group for g in log if not g.backward})
    bwd = [g for g in log if g.backward]
    ex.true(fwd == [world], f"{what}: forward all-gathers over {fwd} ranks, expected [{world}]")
    in_blocks = [g for g in bwd if g.group == K]
    ex.true(bool(in_blocks), f"{what}: no backward all-gather within a {K}-rank block "
                             f"(backward gathered over {sorted({g.group for g in bwd})})")
    others = sorted({(g.label, g.group) for g in bwd if g.group not in (K, world)})
    ex.true(not others, f"{what}: backward all-gathers over unexpected groups {others}")
    if all_in_blocks:
        full = sorted({g.label for g in bwd if g.group != K})
        ex.true(not full, f"{what}: units {full} gathered over {world} ranks in backward")


def in_blocks(fn: Callable[..., None], module: str, all_in_blocks: bool = True
              ) -> Callable[..., None]:
    """`fn` (a scenario taking reshard_after_forward) run at k=K, plus `check_blocks`.

    The harness imports a case by module and function name: assign the result to
    `<fn name>_hpz` in `module` (the caller's `__name__`).
    """
    def case(rank: int, world: int, ex: Expect, **kwargs: Any) -> None:
        assert world % K == 0 and world > K, f"hpZ k={K} needs a multiple of {K} ranks > {K}"
        with record_gathers() as log:
            fn(rank, world, ex, reshard_after_forward=K, **kwargs)
        check_blocks(ex, log, world, fn.__name__, all_in_blocks)

    case.__name__ = case.__qualname__ = f"{fn.__name__}_hpz"
    case.__module__ = module
    return case
