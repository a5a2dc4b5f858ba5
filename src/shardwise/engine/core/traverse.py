"""Find and replace the tensors inside a module's inputs and outputs.

Activations between units come in any shape a model likes: tuples, dicts, namedtuples,
dataclasses (nested ones too), Hugging Face `ModelOutput`s. The hooks need every tensor in
them: to hook outputs for backward, to cast inputs and outputs under mixed precision, and to
mark inputs for the post-backward signal. torch's pytree treats a dataclass it was not told
about as a leaf, which hid its tensors from backward (the storage was freed under them), so
the walk here is written out, dataclasses included.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside `obj`, depth first."""
    out: list[torch.Tensor] = []
    _walk(obj, out.append, 0)
    return out


def _walk(obj: Any, visit: Callable[[torch.Tensor], None], depth: int) -> None:
    if isinstance(obj, torch.Tensor):
        visit(obj)
    elif depth > _MAX_DEPTH:
        return
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name, None), visit, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, visit, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, visit, depth + 1)


# Self-referencing containers are not activations; stop rather than recurse forever.
_MAX_DEPTH = 32


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any, depth: int = 0) -> Any:
    """`obj` with each tensor t replaced by fn(t); containers are rebuilt only if changed."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth > _MAX_DEPTH:
        return obj
    if _is_dataclass_instance(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name, None)
            nv = map_tensors(fn, v, depth + 1)
            if nv is not v:
                changes[f.name] = nv
        if not changes:
            return obj
        new = copy.copy(obj)
        for k, v in changes.items():
            try:
                setattr(new, k, v)  # ModelOutput keeps its dict view in step this way
            except dataclasses.FrozenInstanceError:
                object.__setattr__(new, k, v)
        return new
    if isinstance(obj, dict):
        items = {k: map_tensors(fn, v, depth + 1) for k, v in obj.items()}
        if all(items[k] is obj[k] for k in obj):
            return obj
        new = copy.copy(obj)
        new.update(items)
        return new
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, v, depth + 1) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)
