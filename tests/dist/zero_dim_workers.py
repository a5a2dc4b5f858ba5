"""Issue 41: a 0-d parameter keeps shape () (TinyLM's `blocks.*.gate`), against unsharded.

Its face was a `Shard(0)` DTensor of global shape (1,): `parameters()`, `state_dict()`, DCP
and the optimizer's state all said (1,) where the module declared (). It is now a
`Replicate()` DTensor of shape () held by every rank ([Note: 0-d parameters] in
engine/core/sharded_param.py). FSDP2 refuses 0-d parameters, so the reference is the
unsharded model trained on the whole batch. Workers return numbers; tests/dist/test_zero_dim.py
asserts.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

import shardwise as sw
from shardwise.engine.core.dtensor import local_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 3
GATES = [f"blocks.{i}.gate" for i in range(3)]
MAX_NORM = 0.5  # below the norms of these steps: clipping scales every gradient


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _model(strategy: str, seed: int = 0) -> nn.Module:
    model = make_model("lm", seed)
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
    return model


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, world: int,
          rank: int | None, clip: str) -> float:
    """One step on this rank's slice of the batch (rank None: the whole batch, unsharded);
    the total norm the clipping returned."""
    x, y = make_batch("lm", 100 + step, PER_RANK * world)
    if rank is not None:
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    loss_fn("lm", model(x), y).backward()
    if clip == "sw" and rank is not None:
        norm = sw.clip_grad_norm_(model, MAX_NORM)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    opt.step()
    opt.zero_grad()
    return float(norm)


def _diff(full: dict[str, torch.Tensor], ref: nn.Module) -> float:
    return max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())


def _gates(model: nn.Module) -> list[float]:
    """This rank's copy of each gate (bit patterns compared across ranks by the test)."""
    params = dict(model.named_parameters())
    return [float(local_of(params[g].detach())) for g in GATES]


def shapes(rank: int, world: int, strategy: str) -> dict:
    """The gate's shape wherever torch's tools or shardwise hand it out, after one step."""
    model = _model(strategy)
    opt = _opt(model)
    _step(model, opt, 0, world, rank, "torch")
    gate = dict(model.named_parameters())["blocks.0.gate"]
    sd = model.state_dict()
    sharded = get_model_state_dict(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    st = opt.state[gate]
    return {
        "parameters": _shape(gate),
        "placements": [type(p).__name__ for p in getattr(gate, "placements", ())],
        "state_dict": _shape(sd["blocks.0.gate"]),
        "get_model_state_dict": _shape(sharded["blocks.0.gate"]),
        "get_model_state_dict full": _shape(full["blocks.0.gate"]),
        "full_state_dict": _shape(sw.full_state_dict(model)["blocks.0.gate"]),
        "exp_avg": _shape(st["exp_avg"]),
        "grad after backward": _grad_shape(model, world, rank),
        "ref gate": float(make_model("lm", 0).blocks[0].gate),
        "full gate": float(full["blocks.0.gate"]),
    }


def _grad_shape(model: nn.Module, world: int, rank: int) -> list[int]:
    x, y = make_batch("lm", 7, PER_RANK * world)
    loss_fn("lm", model(x[:PER_RANK]), y[:PER_RANK]).backward()
    g = dict(model.named_parameters())["blocks.0.gate"].grad
    model.zero_grad()
    return _shape(g)


def train(rank: int, world: int, strategy: str, clip: str, steps: int = 4) -> dict:
    """AdamW with clipping (torch's clip_grad_norm_ or sw's) against the unsharded model:
    the norms and the largest parameter difference at every step, and each gate's copy."""
    model, ref = _model(strategy), make_model("lm", 0)
    opt, ref_opt = _opt(model), _opt(ref)
    norms, ref_norms, diffs = [], [], []
    for step in range(steps):
        norms.append(_step(model, opt, step, world, rank, clip))
        ref_norms.append(_step(ref, ref_opt, step, world, None, clip))
        diffs.append(_diff(sw.full_state_dict(model), ref))
    gate = dict(model.named_parameters())["blocks.0.gate"]
    return {"norms": norms, "ref_norms": ref_norms, "diffs": diffs, "gates": _gates(model),
            "ref_gates": [float(b.gate.detach()) for b in ref.blocks],
            "exp_avg": float(local_of(opt.state[gate]["exp_avg"])),
            "ref_exp_avg": float(ref_opt.state[ref.blocks[0].gate]["exp_avg"])}


def _ref_after(steps: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    ref = make_model("lm", 0)
    opt = _opt(ref)
    for step in range(steps):
        _step(ref, opt, step, world, None, "torch")
    return ref, opt


def dcp_save(rank: int, world: int, path: str) -> dict:
    """Two steps at `world` ranks, then dcp.save of get_state_dict (model and optimizer)."""
    model = _model("FULL_SHARD")
    opt = _opt(model)
    for step in range(2):
        _step(model, opt, step, world, rank, "torch")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return {"model": list(md["model.blocks.0.gate"].size),
            "exp_avg": [list(v.size) for k, v in md.items()
                        if k.startswith("optim.state.blocks.0.gate.exp_avg")]}


def dcp_load(rank: int, world: int, path: str, saved_world: int) -> dict:
    """dcp.load at `world` ranks into other weights, then two more steps: the same as an
    unsharded model trained four steps (the first two on `saved_world` ranks' batch)."""
    model = _model("FULL_SHARD", seed=9)
    opt = _opt(model)
    _step(model, opt, 0, world, rank, "torch")  # optimizer state to load into
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    ref, ref_opt = _ref_after(2, saved_world)
    loaded = _diff(sw.full_state_dict(model), ref)
    return _continue(model, opt, ref, ref_opt, rank, world, loaded)


def _continue(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module,
              ref_opt: torch.optim.Optimizer, rank: int, world: int, loaded: float) -> dict:
    for step in range(2, 4):
        _step(model, opt, step, world, rank, "torch")
        _step(ref, ref_opt, step, world, None, "torch")
    gate = dict(model.named_parameters())["blocks.0.gate"]
    return {"loaded": loaded, "after": _diff(sw.full_state_dict(model), ref),
            "gates": _gates(model), "shape": _shape(gate),
            "exp_avg shape": _shape(opt.state[gate]["exp_avg"])}


def ckpt_save(rank: int, world: int, path: str, strategy: str) -> None:
    model = _model(strategy)
    opt = _opt(model)
    for step in range(2):
        _step(model, opt, step, world, rank, "torch")
    sw.save_checkpoint(path, model, opt, step=2)


def ckpt_load(rank: int, world: int, path: str, saved_world: int, strategy: str) -> dict:
    """sw.load_checkpoint at another world size (and strategy), then two more steps."""
    model = _model(strategy, seed=9)
    opt = _opt(model)
    sw.load_checkpoint(path, model, opt)
    ref, ref_opt = _ref_after(2, saved_world)
    return _continue(model, opt, ref, ref_opt, rank, world,
                     _diff(sw.full_state_dict(model), ref))


def export_and_load(rank: int, world: int, path: str) -> dict:
    """export_safetensors of a trained model, then load_pretrained into a meta-built one."""
    model = _model("FULL_SHARD")
    opt = _opt(model)
    for step in range(2):
        _step(model, opt, step, world, rank, "torch")
    want = sw.full_state_dict(model)
    sw.export_safetensors(path, model)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) \
        if os.path.isdir(path) else [path]
    stored = {}
    for f in files:
        with safe_open(os.path.join(path, f) if os.path.isdir(path) else f, "pt") as fh:
            stored |= {k: list(fh.get_slice(k).get_shape()) for k in fh.keys()}
    with torch.device("meta"):
        fresh = make_model("lm", 3)
    sw.shard_model(fresh, auto_wrap_policy="transformer")
    sw.load_pretrained(fresh, path)
    got = sw.full_state_dict(fresh)
    return {"stored": stored.get("blocks.0.gate"),
            "diff": max(float((got[k] - v).abs().max()) for k, v in want.items()),
            "shape": _shape(dict(fresh.named_parameters())["blocks.0.gate"]),
            "gates": _gates(fresh), "want": [float(want[g]) for g in GATES]}


def bits(values: list[float]) -> list[int]:
    """float32 bit patterns, so the test compares copies exactly."""
    return np.asarray(values, dtype=np.float32).view(np.int32).tolist()


def is_replicate(placements: list[str]) -> bool:
    return bool(placements) and all(p == Replicate.__name__ for p in placements)
