"""Issue 22: torchtitan's meta-device route on shardwise and on FSDP2 side by side (build
on meta, shard, `to_empty`, initialize the DTensor parameters), loading a meta model with
DCP's set_model_state_dict, `sw.materialize(init_fn)` on full shapes, and one-rank meshes
(DTensor parameters, DCP save/load at world size 1)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

import shardwise as sw
from tests.dist.fsdp2_identity_workers import (
    IMPLS,
    Net,
    _ref_grads,
    _train_step,
    close,
    close_all,
    data,
    full,
    make,
    mine,
    shard,
)


def _full_shape_init(module: nn.Module) -> None:
    """An init that reasons about full shapes (torchtitan's fused-QKV kind): each third of
    a Linear's rows gets its own value from the *full* row count, built as a full tensor
    and distributed; biases get 1 / full size in place."""
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()  # ones_ / zeros_ on the DTensors
    if not isinstance(module, nn.Linear):
        return
    w, b = module.weight, module.bias
    rows, cols = w.shape
    third = max(rows // 3, 1)
    value = torch.arange(rows, dtype=torch.float32).div(third).floor().add(1).div(rows)
    value = value[:, None].expand(rows, cols) + torch.arange(cols) / 100.0
    with torch.no_grad():
        if isinstance(w, DTensor):
            w.copy_(distribute_tensor(value, w.device_mesh, w.placements))
        else:
            w.copy_(value)
        nn.init.constant_(b, 1.0 / b.shape[0])


def _reference() -> Net:
    ref = make()
    for m in ref.modules():
        _full_shape_init(m)
    return ref


def meta_init(rank: int, world: int) -> None:
    ref = _reference()
    want = {k: v for k, v in ref.state_dict().items()}
    x, _ = data(0)
    for name, fs in IMPLS.items():
        # to_empty, then an init on the DTensor parameters: the unsharded model's weights.
        with torch.device("meta"):
            model = Net()
        shard(model, fs)
        model.to_empty(device="cpu")
        assert not any(p.is_meta for p in model.parameters()), f"{name}: still meta"
        for m in model.modules():
            _full_shape_init(m)
        got = {k: full(v) for k, v in model.state_dict().items()}
        close_all(got, want, f"{name} to_empty + init")
        close(model(x[:2]), ref(x[:2]), f"{name} first forward after to_empty")
        close_all(_train_step(model, rank, world), _grads_of(ref, rank, world),
                  f"{name} grads after to_empty")

        # Random inits on the DTensor parameters draw what FSDP2's do on the same mesh.
        with torch.device("meta"):
            rnd = Net()
        shard(rnd, fs)
        rnd.to_empty(device="cpu")
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
            for m in rnd.modules():
                if isinstance(m, nn.Linear):
                    nn.init.trunc_normal_(m.weight, std=0.02)
        _RANDOM[name] = {f"{n}.weight": m.weight.to_local().clone()
                         for n, m in rnd.named_modules() if isinstance(m, nn.Linear)}

        # A meta model loaded through DCP's helpers (no to_empty): the values arrive.
        with torch.device("meta"):
            loaded = Net()
        shard(loaded, fs)
        set_model_state_dict(loaded, ref.state_dict(),
                             options=StateDictOptions(full_state_dict=True))
        got = get_model_state_dict(loaded, options=StateDictOptions(full_state_dict=True))
        close_all(got, want, f"{name} set_model_state_dict into a meta model")
        close(loaded(x[:2]), ref(x[:2]), f"{name} forward after set_model_state_dict")
    close_all(_RANDOM["shardwise"], _RANDOM["fsdp2"], "random init: shardwise vs FSDP2", 0)

    # sw.materialize(model, init_fn): init_fn sees DTensors of full shape.
    with torch.device("meta"):
        model = Net()
    shard(model, sw.fully_shard)
    shapes: list[tuple[int, ...]] = []

    def init_fn(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            shapes.append(tuple(m.weight.shape))
        _full_shape_init(m)

    sw.materialize(model, init_fn)
    assert (7, 5) in shapes and (2, 5) in shapes, shapes
    close_all({k: full(v) for k, v in model.state_dict().items()}, want, "materialize")


_RANDOM: dict[str, dict[str, torch.Tensor]] = {}


def _grads_of(ref: nn.Module, rank: int, world: int) -> dict[str, Any]:
    ref.zero_grad()
    x, y = data(0)
    nn.functional.mse_loss(ref(x), y).backward()
    g = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    return g


def one_rank(rank: int, world: int, path: str) -> None:
    """World size 1: DTensor parameters and gradients (what Lightning Fabric's
    ModelParallelStrategy looks for), training as the reference, DCP save and load."""
    model = shard(make(), sw.fully_shard)
    params = dict(model.named_parameters())
    plain = [n for n, p in params.items() if not isinstance(p, DTensor)]
    assert not plain, f"plain parameters at world size 1: {plain}"
    close_all(_train_step(model, rank, world), _ref_grads(), "one rank grads")
    model(mine(data(0)[0], rank, world)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    model.zero_grad()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    other = shard(Net(), sw.fully_shard)
    sd = {"model": other.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    other.load_state_dict(sd["model"])
    close_all({k: full(v) for k, v in other.state_dict().items()},
              {k: full(v) for k, v in model.state_dict().items()}, "one rank DCP round trip")
    assert os.path.isdir(path)
