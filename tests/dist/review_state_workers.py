"""Review: 0-d parameters through PyTorch's own state-dict tools.

A 0-d parameter (TinyLM's `blocks.*.gate`) is one row held by shard rank 0. Its face was a
plain tensor of shape (1,) there and (0,) on the other ranks, so PyTorch's tools, which
read a plain tensor as the whole (replicated) value, got it wrong with no error:
`get_model_state_dict(full_state_dict=True)` gave an empty tensor on every rank but 0, and
`dcp.save` stored the parameter empty (rank 1's copy), which only failed at load. The face
became a DTensor of global shape (1,), and then (issue 41) a `Replicate()` DTensor of shape
(): every rank holds the value, and torch's tools see the shape the module declared.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import shardwise as sw
from tests.models import make_model


def zero_dim_full_state_dict(rank: int, world: int) -> dict:
    """get_model_state_dict(full_state_dict=True) on every rank: the gate's value."""
    ref = make_model("lm", 0)
    model = make_model("lm", 0)
    sw.shard_model(model, auto_wrap_policy="transformer")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    g = full["blocks.0.gate"]
    return {"shape": list(g.shape), "values": g.reshape(-1).tolist(),
            "ref": ref.blocks[0].gate.item()}


def zero_dim_dcp_save(rank: int, world: int, path: str) -> dict:
    """dcp.save(get_model_state_dict(model)) with the gate set to 0.25: what is stored."""
    model = make_model("lm", 0)
    sw.shard_model(model, auto_wrap_policy="transformer")
    with torch.no_grad():
        dict(model.named_parameters())["blocks.0.gate"].fill_(0.25)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    md = FileSystemReader(path).read_metadata()
    return {"saved_shape": list(md.state_dict_metadata["model.blocks.0.gate"].size)}


def zero_dim_dcp_load(rank: int, world: int, path: str) -> float:
    """dcp.load of that checkpoint at another world size: the gate comes back as saved."""
    model = make_model("lm", 1)
    sw.shard_model(model, auto_wrap_policy="transformer")
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    return float(sw.full_state_dict(model)["blocks.0.gate"].item())
