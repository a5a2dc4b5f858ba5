"""`sw.patch_fsdp2()`: the one-line switch for a framework that imports FSDP2 itself.

Your own code switches by its import (`from shardwise.fsdp2 import fully_shard`). A framework
such as torchtitan imports `torch.distributed.fsdp` in its own files; one call, made in each
rank before the framework's parallelize function, switches it::

    import shardwise as sw
    sw.patch_fsdp2()                   # or: with sw.patched_fsdp2(): parallelize(model)

It puts shardwise's `fully_shard` (and `register_fsdp_forward_method`, `share_comm_ctx`)
where FSDP2's were: in `torch.distributed.fsdp` and its
aliases, and in every module already imported that bound FSDP2's function by name
(torchtitan's `from torch.distributed.fsdp import fully_shard`); modules imported later get
them through torch's. Nothing else moves: the classes stay torch's own, since a sharded module
is an `FSDPModule` (frameworks find FSDP by that `isinstance`) and `fully_shard` takes torch's
`MixedPrecisionPolicy` / `CPUOffloadPolicy` / `OffloadPolicy`. torch's own internals keep
FSDP2's function, so FSDP2 still works on the modules it shards.
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

# Where torch itself exports the name: the public module and its older aliases.
_TORCH_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp",
                "torch.distributed.fsdp._fully_shard")

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
        # FSDP2's FSDPModule methods call fully_shard.state() through their own module's
        # global: torch's internals keep FSDP2's function, only its public homes switch.
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

    with contextlib.suppress(ImportError):  # an older alias, gone in some releases
        import torch.distributed._composable.fsdp  # noqa: F401


def patch_fsdp2() -> Callable[[], None]:
    """Make FSDP2's `fully_shard`, `register_fsdp_forward_method` and `share_comm_ctx` be
    shardwise's everywhere they are bound; return the undo."""
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
