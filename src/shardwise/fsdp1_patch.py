"""`sw.patch_fsdp1()`: the one-line switch for a framework that imports FSDP1 itself.

Your own code switches by its import (`from shardwise.fsdp1 import FullyShardedDataParallel`).
Accelerate (`fsdp_version: 1`, the HF Trainer's default FSDP path) and Lightning's
`FSDPStrategy` import `torch.distributed.fsdp.FullyShardedDataParallel` in their own files,
some at import time, some inside functions; one call in each rank switches them::

    import shardwise as sw
    sw.patch_fsdp1()                   # or: with sw.patched_fsdp1(): ...

As `patch_fsdp2()` does for FSDP2's functions (fsdp2_patch.py), it puts shardwise's class
where FSDP1's was bound: in the torch namespaces that export it (`_TORCH_HOMES`), read by
imports made later, and in every module already imported that bound it as a global under any
name (`from torch.distributed.fsdp import FullyShardedDataParallel as FSDP` made before the
patch). torch's other internals keep FSDP1's class (DCP's state-dict helpers then treat a
shardwise model by its DTensor parameters, as an FSDP2 one). The undo puts FSDP1's class back
in exactly the places the patch changed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# DCP's state-dict helpers and NamedOptimizer bind FSDP1's class at import and must keep it:
# imported here, before any patch, so that neither is first imported under the patch and binds
# shardwise's (DCP would then take a manually nested model's inner wrappers for FSDP1
# instances: `.process_group`, FSDP.optim_state_dict back into shardwise).
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp as _torch_fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel  # noqa: F401  (a home, below)
import torch.distributed.optim.named_optimizer  # noqa: F401

from .fsdp1 import FullyShardedDataParallel

# The torch namespaces that export FSDP1's class (torch 2.13): the public package and the
# module that defines it.
_TORCH_HOMES = ("torch.distributed.fsdp", "torch.distributed.fsdp.fully_sharded_data_parallel")

# FSDP1's class, taken at import (before any patch) so undo can restore it.
_THEIRS: Any = _torch_fsdp.FullyShardedDataParallel


def _bindings() -> Iterator[tuple[Any, str]]:
    """(module, attribute) for every imported module that holds FSDP1's class."""
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if mod is None or name.startswith("shardwise") or (
                name.startswith("torch.") and name not in _TORCH_HOMES):
            continue
        try:
            names = vars(mod)
        except TypeError:
            continue
        for attr, value in list(names.items()):
            if value is _THEIRS:
                yield mod, attr


def patch_fsdp1() -> Callable[[], None]:
    """Make FSDP1's `FullyShardedDataParallel` be shardwise's everywhere it is bound as a
    module global; return the undo. References held elsewhere (a closure, a dict, a default
    argument) are not reached."""
    swapped = list(_bindings())
    for mod, attr in swapped:
        setattr(mod, attr, FullyShardedDataParallel)

    def undo() -> None:
        for mod, attr in swapped:
            if getattr(mod, attr, None) is FullyShardedDataParallel:
                setattr(mod, attr, _THEIRS)

    return undo


@contextmanager
def patched_fsdp1() -> Iterator[None]:
    """`patch_fsdp1()` for the length of a `with` block; FSDP1's class is back after."""
    undo = patch_fsdp1()
    try:
        yield
    finally:
        undo()
