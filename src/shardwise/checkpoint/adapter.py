"""A peft adapter folder from a sharded model: `sw.save_adapter(path, model)`.

peft's own `model.save_pretrained(dir)` cannot save a sharded model: safetensors asks each
DTensor for its storage's data pointer ("Attempted to access the data pointer on an invalid
python storage") after README.md is already written. This gathers only the trainable
tensors (the adapters: a fraction of a percent of a LoRA model), one at a time, and rank 0
hands them to peft's `save_pretrained(..., state_dict=...)` inside a temporary folder that is
renamed into place once complete: the folder appears whole or not at all.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from ..engine.core.context import model_group
from ..engine.core.policies import check_module, check_path
from .state_dict import gather_full
from .sync import agreed, as_error


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors, full, on CPU, under the model's state-dict keys (every rank
    must call it; each is all-gathered in turn)."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in trainable:
            continue
        sp = getattr(t, "_sw_param", None)
        full = gather_full(sp) if sp is not None else t.detach()
        out[key] = full.detach().to("cpu", copy=True)
    return out


def save_adapter(path: str | os.PathLike, model: nn.Module) -> str:
    """Write the peft adapter folder of a sharded peft `model` at `path` (adapter_config.json,
    adapter_model.safetensors, README.md): what `PeftModel.from_pretrained` loads.

    Every rank of the model must call it; the model's first rank writes (rank 0 unless the
    model runs on a subgroup). `path` must not exist yet, or be an empty folder.
    Returns the folder's absolute path.
    """
    group = model_group(model)
    with agreed(group=group):
        out = os.path.abspath(check_path("path", path))
        check_module("model", model)
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise ValueError(f"path={os.fspath(path)!r} already exists; give a new folder "
                             "(an adapter folder is never written over)")
        if not hasattr(model, "peft_config") or not callable(getattr(model, "save_pretrained",
                                                                      None)):
            raise ValueError(f"model={type(model).__name__} is not a peft model (give the "
                             "model get_peft_model returned)")
    sd = adapter_state_dict(model)
    with agreed(as_error, group=group):
        if group.is_first:
            tmp = f"{out}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
                if os.path.isdir(out):
                    os.rmdir(out)  # empty, checked above
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out
