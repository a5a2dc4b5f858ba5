"""`sw.patch_fsdp2()`: the one-line switch for a framework that imports FSDP2 itself.

Your own code switches by its import (`from shardwise.fsdp2 import fully_shard`). A framework
such as torchtitan imports `torch.distributed.fsdp` in its own files; one call, made in each
rank before the framework's parallelize function, switches it::

    import shardwise as sw
    sw.patch_fsdp2()                   # or: with sw.patched_fsdp2(): parallelize(model)

It puts shardwise's `fully_shard` (and `register_fsdp_forward_method`, `share_comm_ctx`)
where FSDP2's were: in every torch namespace that exports them (`_TORCH_HOMES`), and in every
module already imported that bound FSDP2's function as a global, under any name (torchtune's
and torchtitan's `from torch.distributed._composable.fsdp import fully_shard`, made at their
import, before the patch); modules imported later get them through torch's. So the patch
may come before or after the framework's imports. Nothing else moves: the classes stay
torch's own, since a sharded module is an `FSDPModule` (frameworks find FSDP by that
`isinstance`) and `fully_shard` takes torch's `MixedPrecisionPolicy` / `CPUOffloadPolicy` /
`OffloadPolicy`. FSDP2 still works while patched, on the modules it shards: its own
`fully_shard` reads its state through its module's global, which is then shardwise's, and
shardwise's `fully_shard.state` answers with FSDP2's state for a module FSDP2 sharded.
torch's other internals (pipelining's stage code) keep FSDP2's function.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed.fsdp as _torch_fsdp

from .engine.api.fully_shard import fully_shard
from .engine.api.state import register_fsdp_forward_method, share_comm_ctx

# Every torch namespace that exports the names (torch 2.13): the public module, the package
# and module that define them, and the older `_composable` paths kept for compatibility.
_TORCH_HOMES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                "torch.distributed.fsdp._fully_shard._fully_shard",
                "torch.distributed._composable.fsdp",
                "torch.distributed._composable.fsdp.fully_shard")

# FSDP2's own functions -> shardwise's, taken at import (before any patch) so undo can
# restore them. The three act on sharded modules, so they switch together.
_SWAP: dict[int, tuple[Any, Any]] = {
    id(getattr(_torch_fsdp, name)): (getattr(_torch_fsdp, name), ours)
    for name, ours in (("fully_shard", fully_shard),
                       ("register_fsdp_forward_method", register_fsdp_forward_method),
                       ("share_comm_ctx", share_comm_ctx))
}


def _bindings() -> Iterator[tuple[Any, str, Any, Any]]:
    """(module, attribute, FSDP2's, shardwise's) for every imported module that holds one
    of FSDP2's functions."""
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        # torch's internals other than the homes keep FSDP2's function: they use it on
        # modules FSDP2 sharded (pipelining's stage reads FSDP2's state through it).
        if mod is None or name.startswith("shardwise") or (
                name.startswith("torch.") and name not in _TORCH_HOMES):
            continue
        try:
            names = vars(mod)
        except TypeError:
            continue
        for attr, value in list(names.items()):
            pair = _SWAP.get(id(value))
            if pair is not None and pair[0] is value:
                yield mod, attr, pair[0], pair[1]


def _import_homes() -> None:
    """Import torch's FSDP2 homes (fixed names, statically: no dynamic imports in the
    library) so that their bindings can be swapped."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.fsdp._fully_shard  # noqa: F401
    import torch.distributed.fsdp._fully_shard._fully_shard  # noqa: F401

    with contextlib.suppress(ImportError):  # older aliases, gone in some releases
        import torch.distributed._composable.fsdp  # noqa: F401
        import torch.distributed._composable.fsdp.fully_shard  # noqa: F401


def patch_fsdp2() -> Callable[[], None]:
    """Make FSDP2's `fully_shard`, `register_fsdp_forward_method` and `share_comm_ctx` be
    shardwise's everywhere they are bound as module globals; return the undo, which puts
    FSDP2's back in exactly the places this call changed (a module imported while patched
    keeps the shardwise function it bound). References held elsewhere (a closure, a default
    argument, a `functools.partial`, a dict) are not reached."""
    _import_homes()
    swapped = list(_bindings())
    for mod, attr, _, ours in swapped:
        setattr(mod, attr, ours)

    def undo() -> None:
        for mod, attr, theirs, ours in swapped:
            if getattr(mod, attr, None) is ours:
                setattr(mod, attr, theirs)

    return undo


@contextmanager
def patched_fsdp2() -> Iterator[None]:
    """`patch_fsdp2()` for the length of a `with` block; FSDP2's function is back after."""
    undo = patch_fsdp2()
    try:
        yield
    finally:
        undo()
