"""Model-level operations on a model sharded on a subgroup ([Note: model ranks]).

The model runs on ranks {1, 2} of 3 ("pair": its first rank is 1, not 0) or on a 2 x 2
HYBRID_SHARD mesh over ranks {1, 2, 3, 4} of 5 ("hybrid": no single group spans it, so
every model-level collective goes over the mesh's dims in turn). Rank 0 trains a model of
its own meanwhile, alone, and then waits in the barrier at the end: a model-level
operation that still used the world (a broadcast from world rank 0, an agreement or a
gather over the world) met that barrier instead, or waited for it, and failed at the
collective timeout. Each operation is checked against the unsharded model on one process.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import shardwise as sw
from shardwise.engine.comm import collectives as C
from shardwise.engine.core.context import model_group
from tests.models import TinyLM, loss_fn, make_batch

PER_RANK = 2
LAYOUTS = {"pair": (3, [1, 2]), "hybrid": (5, [1, 2, 3, 4])}


class BufLM(TinyLM):
    """TinyLM with a persistent buffer that `reset_parameters` draws (replicated, not
    sharded: materialize must give every rank the first rank's draw; checkpoints and
    exports must write it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.randn(6) * 0.1)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.shift.normal_(std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]] + self.shift
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BufLM()


def meshes(layout: str) -> tuple[int, list[int], DeviceMesh, str]:
    """(world, model ranks, the model's mesh, strategy); every rank makes the mesh."""
    world, ranks = LAYOUTS[layout]
    if layout == "hybrid":
        mesh = DeviceMesh("cpu", torch.tensor(ranks).view(2, 2), mesh_dim_names=("rep", "shard"))
        return world, ranks, mesh, "HYBRID_SHARD"
    return world, ranks, DeviceMesh("cpu", ranks), "FULL_SHARD"


def shard(model: nn.Module, mesh: DeviceMesh, strategy: str) -> nn.Module:
    return sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                          mesh=mesh)


def _outsider(steps: int = 3) -> float:
    """What rank 0 does meanwhile: train an unsharded model of its own (no collectives)."""
    model = nn.Linear(13, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = make_batch("mlp", 50 + step, 4)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.item())


def run(rank: int, world: int, layout: str, ops: list[str], path: str = "") -> dict:
    """Run `ops` in order on the model's ranks; rank 0 trains alone. All meet at a barrier."""
    assert world == LAYOUTS[layout][0]
    _, ranks, mesh, strategy = meshes(layout)
    out: dict = {}
    if rank not in ranks:
        out["outsider"] = _outsider()
    else:
        me = ranks.index(rank)
        for op in ops:
            out[op] = OPS[op](me, ranks, mesh, strategy, os.path.join(path, op))
    C.barrier(label="test end")
    return out


def _sd(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return list(got) == list(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def _train(model: nn.Module, ref: nn.Module, me: int, n: int, steps: int, *,
           scaler: sw.ShardedGradScaler | None = None, inf_at: int = -1,
           inf_rank: int = -1) -> dict[str, float]:
    """AdamW steps with clipping against the unsharded reference on the global batch.
    `inf_at`: at that step the model rank `inf_rank` finds an inf in its gradient shard,
    so every rank's scaler must skip the step (the reference skips it too)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    worst = {"loss": 0.0, "norm": 0.0, "params": 0.0, "skipped": 0}
    for step in range(steps):
        x, y = make_batch("lm", 10 + step, n * PER_RANK)
        mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
        loss = loss_fn("lm", model(x[mine]), y[mine])
        (scaler.scale(loss) if scaler is not None else loss).backward()
        ref_loss = loss_fn("lm", ref(x), y)
        ref_loss.backward()
        with torch.no_grad():
            worst["loss"] = max(worst["loss"], abs(
                loss.item() - loss_fn("lm", ref(x[mine]), y[mine]).item()))
        if step == inf_at and me == inf_rank:
            g = next(p.grad for p in model.parameters()
                     if p.grad is not None and p.grad.to_local().numel())
            g.to_local().view(-1)[0] = float("inf")
        if scaler is not None:
            scaler.unscale_(opt)
        if step != inf_at:
            norm = sw.clip_grad_norm_(model, 0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()))
        stepped = scaler.step(opt) if scaler is not None else (opt.step() or True)
        if scaler is not None:
            scaler.update()
        if stepped:
            ref_opt.step()
        else:
            worst["skipped"] += 1
        opt.zero_grad()
        ref_opt.zero_grad()
    got = sw.full_state_dict(model)
    for k, v in ref.state_dict().items():
        worst["params"] = max(worst["params"], (got[k] - v).abs().max().item())
    return worst


# --- the operations -------------------------------------------------------------------


def op_materialize(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str,
                   path: str) -> dict:
    """A meta-built model, ranks seeded differently, materialized without a seed: replicas
    must start identical (one agreed seed) and the drawn buffer must be the first rank's.
    Returns the full state dict, compared across the model's ranks by the test."""
    torch.manual_seed(1000 + ranks[me])
    with torch.device("meta"):
        model = BufLM()
    shard(model, mesh, strategy)
    sw.materialize(model)
    # As lists: tensors cannot cross the result queue once the rank has exited.
    return {"sd": {k: v.tolist() for k, v in sw.full_state_dict(model).items()}}


def op_state_dict(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str,
                  path: str) -> dict:
    """full_state_dict(rank0_only=True) keeps the tensors on the model's first rank only;
    load_full_state_dict(from_rank0=True) into a meta-built model takes them from there;
    then training matches the reference."""
    ref = make(0)
    model = shard(copy.deepcopy(ref), mesh, strategy)
    first = sw.full_state_dict(model, rank0_only=True)
    group = model_group(model)
    res: dict = {"model ranks": list(group.ranks), "groups": len(group.groups),
                 "rank0_only keys": len(first),
                 "rank0_only exact": _exact(first, _sd(ref)) if first else None}
    with torch.device("meta"):
        fresh = BufLM()
    shard(fresh, mesh, strategy)
    try:  # only the first rank provides the state dict: refused elsewhere, by name
        sw.load_full_state_dict(fresh, None if me == 0 else _sd(ref), from_rank0=True)
    except ValueError as e:
        res["sd=None on the first rank"] = str(e)
    sw.load_full_state_dict(fresh, _sd(ref) if me == 0 else None, from_rank0=True)
    res["loaded exact"] = _exact(sw.full_state_dict(fresh), _sd(ref))
    res.update(_train(fresh, ref, me, len(ranks), 2))
    return res


def op_scaler(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str, path: str) -> dict:
    """ShardedGradScaler: an inf in the last model rank's shard at step 1 skips the step on
    every rank of the model (the found-inf flag is reduced over the model's ranks), and
    sw.clip_grad_norm_ is the reference's norm."""
    ref = make(0)
    model = shard(copy.deepcopy(ref), mesh, strategy)
    scaler = sw.ShardedGradScaler(init_scale=2.0**4, growth_interval=1)
    res = _train(model, ref, me, len(ranks), 3, scaler=scaler, inf_at=1,
                 inf_rank=len(ranks) - 1)
    return {**res, "scale": scaler.get_scale()}


def op_checkpoint(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str,
                  path: str) -> dict:
    """save_checkpoint after a step, a refusal named on every rank of the model, then
    load_checkpoint into a differently initialized model sharded the other way (SHARD_GRAD_OP
    when it was FULL_SHARD) and one more step: the reference's two steps."""
    ref = make(0)
    model = shard(copy.deepcopy(ref), mesh, strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    n = len(ranks)
    x, y = make_batch("lm", 10, n * PER_RANK)
    mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
    loss_fn("lm", model(x[mine]), y[mine]).backward()
    loss_fn("lm", ref(x), y).backward()
    opt.step()
    ref_opt.step()
    ref_opt.zero_grad()
    res: dict = {}
    try:
        sw.save_checkpoint(path, model, opt, step=-1)
    except ValueError as e:
        res["refused"] = str(e)
    sw.save_checkpoint(path, model, opt, step=1, extra={"first": ranks[0]})
    saved = sw.full_state_dict(model)
    other = "SHARD_GRAD_OP" if strategy == "FULL_SHARD" else strategy
    loaded = shard(make(5), mesh, other)
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    res["extra"] = sw.load_checkpoint(path, loaded, opt2)
    res["loaded exact"] = _exact(sw.full_state_dict(loaded), saved)
    x, y = make_batch("lm", 11, n * PER_RANK)
    loss_fn("lm", loaded(x[mine]), y[mine]).backward()
    loss_fn("lm", ref(x), y).backward()
    opt2.step()
    ref_opt.step()
    got = sw.full_state_dict(loaded)
    res["params"] = max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    with open(os.path.join(path, "manifest.json")) as f:
        res["saved_by"] = json.load(f)["saved_by"]
    return res


def op_export(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str, path: str) -> dict:
    """export_safetensors (written by the first rank) and load_pretrained of that export into
    a meta-built model: the reference's weights, bit for bit."""
    ref = make(0)
    model = shard(copy.deepcopy(ref), mesh, strategy)
    files = sw.export_safetensors(path, model)
    with torch.device("meta"):
        fresh = BufLM()
    shard(fresh, mesh, strategy)
    result = sw.load_pretrained(fresh, path)
    return {"files": files, "missing": result.missing_keys,
            "loaded exact": _exact(sw.full_state_dict(fresh), _sd(ref))}


def op_trace(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str, path: str) -> dict:
    """sw.trace: the start check and the merge run over the model's ranks; its first rank
    writes the merged trace."""
    model = shard(make(0), mesh, strategy)
    with sw.trace(path, model) as t:
        for step in range(1, 3):
            t.step(step)
            x, _ = make_batch("lm", step, PER_RANK)
            model(x).sum().backward()
    return {"files": sorted(os.listdir(path)), "rows": len(t.report.rows)}


def op_no_shard(me: int, ranks: list[int], mesh: DeviceMesh, strategy: str,
                path: str) -> dict:
    """NO_SHARD on the model's mesh: gradients all-reduced over the model's ranks only."""
    ref = make(0)
    model = shard(copy.deepcopy(ref), mesh, "NO_SHARD")
    return _train(model, ref, me, len(ranks), 2)


OPS = {"materialize": op_materialize, "state_dict": op_state_dict, "scaler": op_scaler,
       "checkpoint": op_checkpoint, "export": op_export, "trace": op_trace,
       "no_shard": op_no_shard}


def two_models(rank: int, world: int, path: str) -> dict:
    """Model A on ranks {0, 1} and model B (other weights) on {2, 3} run the same
    model-level operations at the same time: each keeps to its own ranks, B's first rank is
    2. Over the world, their agreements met each other's and rank 0 gathered and merged
    both models' checkpoint reports, while no rank wrote B's manifest."""
    meshes_ = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]
    which, me = divmod(rank, 2)
    name = "AB"[which]
    ref = make(which)
    model = shard(copy.deepcopy(ref), meshes_[which], "FULL_SHARD")
    res: dict = {"rank0_only keys": len(sw.full_state_dict(model, rank0_only=True))}
    res.update(_train(model, ref, me, 2, 1, scaler=sw.ShardedGradScaler()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sw.save_checkpoint(os.path.join(path, name), model, opt, step=which, extra={"model": name})
    saved = sw.full_state_dict(model)
    loaded = shard(make(7), meshes_[which], "SHARD_GRAD_OP")
    res["extra"] = sw.load_checkpoint(os.path.join(path, name), loaded,
                                      torch.optim.SGD(loaded.parameters(), lr=0.1))
    res["loaded exact"] = _exact(sw.full_state_dict(loaded), saved)
    C.barrier(label="test end")
    return res
