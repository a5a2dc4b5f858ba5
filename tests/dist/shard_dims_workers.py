"""Parameters sharded on a dim other than 0: FSDP2's `shard_placement_fn` (Shard(1), Shard(2)),
torchtitan's experts on a mesh of their own, and the balanced default for 3-D experts with
fewer experts than ranks ([Note: balanced shards] in engine/core/layout.py).

Each case trains the same model three ways in one process group: shardwise, torch's own
FSDP2 running the same client code (where FSDP2 allows the layout: it refuses uneven
Shard(d != 0)), and the unsharded reference on the whole batch. Losses every step, full
gradients every step and full parameters after the last step must agree at 1e-5.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Shard

import shardwise as sw
from shardwise.engine.comm import collectives as C

D, F, VOCAB = 10, 6, 32  # D is uneven at 3 ranks and 4 ranks; F divides 2 and 3
PER_RANK, STEPS, TOL = 3, 3, 1e-5


class Experts(nn.Module):
    """All experts as 3-D tensors, torchtitan's GroupedExperts style: (E, F, D) each, so
    Shard(1) divides at 2 and 3 ranks (FSDP2 needs that) and Shard(2) does not."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.w1 = nn.Parameter(torch.randn(n, F, D) * 0.3)
        self.w2 = nn.Parameter(torch.randn(n, F, D) * 0.3)

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in range(self.n):
            mask = (route == e).to(h.dtype).unsqueeze(1)
            # every expert runs on every rank (a masked dense pass): the same gradients'
            # structure on each rank whatever the routing
            y = torch.tanh(h @ self.w1[e].t()) @ self.w2[e]
            out = out + y * mask
        return out


class Block(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.experts = Experts(n)

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return h + self.experts(self.norm(h), route)


class Model(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(n) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        route = ids % self.n
        for b in self.blocks:
            h = b(h, route)
        return self.head(h)


def batch(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (world * PER_RANK,), generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids), (ids * 7 + 3) % VOCAB)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


Shard_ = Callable[[nn.Module, Any], None]  # (model, fully_shard) -> shards it


def train(model: nn.Module, rank: int, world: int, sharded: bool) -> dict[str, Any]:
    """STEPS steps of SGD (momentum: state shaped like the shards); losses, every step's full
    gradients and the final full parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for step in range(STEPS):
        ids = batch(step, world)
        if sharded:
            ids = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = loss_of(model, ids)
        loss.backward()
        if sharded:
            t = loss.detach().reshape(1).clone()
            C.all_reduce(t, None)
            losses.append(t.item() / world)
        else:
            losses.append(loss.item())
        grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: full(p.detach()).clone() for n, p in model.named_parameters()}}


def compare(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= TOL, f"{what}: loss {a} vs {b}"
    for step, (ga, gb) in enumerate(zip(got["grads"], want["grads"])):
        for n, g in gb.items():
            diff = (ga[n] - g).abs().max().item()
            assert diff <= TOL, f"{what}: step {step} grad {n} differs by {diff}"
    for n, p in want["params"].items():
        diff = (got["params"][n] - p).abs().max().item()
        assert diff <= TOL, f"{what}: param {n} differs by {diff}"


def expert_dim(fn: Any) -> Callable[[nn.Parameter], Any]:
    return lambda p: fn if p.dim() == 3 else None


def shard_blocks(dim: int | None) -> Shard_:
    """One unit per block; experts on Shard(dim) through the block's shard_placement_fn."""
    def go(model: nn.Module, fs: Any) -> None:
        place = None if dim is None else expert_dim(Shard(dim))
        for b in model.blocks:
            fs(b, shard_placement_fn=place)
        fs(model)
    return go


def shard_titan(dim: int, mesh_of: Callable[[], Any]) -> Shard_:
    """torchtitan's pattern: the experts module on its own mesh with Shard(dim), then the
    block and the root on the dense mesh (the default)."""
    def go(model: nn.Module, fs: Any) -> None:
        for b in model.blocks:
            fs(b.experts, mesh=mesh_of(), shard_placement_fn=lambda p: Shard(dim))
            fs(b)
        fs(model)
    return go


def check_layout(model: nn.Module, want_dim: int, what: str) -> None:
    """Each expert tensor is a DTensor placed Shard(want_dim) whose local tensor is this
    rank's torch.chunk of the full tensor along that dim."""
    for n, p in model.named_parameters():
        if p.dim() != 3:
            continue
        assert p.placements[-1] == Shard(want_dim), f"{what}: {n} {p.placements}"
        mesh = p.device_mesh
        size = mesh.size(mesh.ndim - 1)
        r = mesh.get_local_rank(mesh.ndim - 1)
        whole = p.full_tensor()
        chunks = torch.chunk(whole, size, dim=want_dim)
        want = chunks[r] if r < len(chunks) else whole.narrow(want_dim, 0, 0)
        assert torch.equal(p.to_local(), want), f"{what}: {n}'s local is not chunk {r}"


def parity(rank: int, world: int, cases: list[tuple[str, int, Shard_, int, bool]]
           ) -> dict[str, Any]:
    """Each case: (name, experts, how to shard, expected expert dim, also on FSDP2)."""
    out: dict[str, Any] = {}
    for name, n, how, want_dim, with_fsdp2 in cases:
        torch.manual_seed(0)
        base = Model(n)
        ref = train(copy.deepcopy(base), rank, world, sharded=False)
        model = copy.deepcopy(base)
        how(model, sw.fully_shard)
        check_layout(model, want_dim, name)
        out[name] = {n_: p.to_local().numel() for n_, p in model.named_parameters()
                     if p.dim() == 3}
        got = train(model, rank, world, sharded=True)
        compare(got, ref, f"{name}: shardwise vs unsharded")
        if with_fsdp2:
            theirs = copy.deepcopy(base)
            how(theirs, fsdp2_fully_shard)
            check_layout(theirs, want_dim, name + " (FSDP2)")
            compare(got, train(theirs, rank, world, sharded=True),
                    f"{name}: shardwise vs FSDP2")
    return out


def world_mesh() -> Any:
    return init_device_mesh("cpu", (C.world_size(),))


def hsdp_experts_mesh() -> Any:
    """(replicate 2, shard 2) over 4 ranks: experts sharded on 2 ranks, HSDP-style."""
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def state_round_trips(rank: int, world: int, path: str, dim: int | None) -> dict[str, Any]:
    """Train a step with experts on Shard(dim) (None: the balanced default), then: the full
    state dict equals the gathered DTensors; model.state_dict() loads back (assign); the
    sharded checkpoint (with SGD momentum) saves; exported safetensors equal the full
    state. Returns the full state and momentum for a load at another world size."""
    torch.manual_seed(0)
    model = Model(2)
    shard_blocks(dim)(model, sw.fully_shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = batch(0, world)[rank * PER_RANK:(rank + 1) * PER_RANK]
    loss_of(model, ids).backward()
    opt.step()
    fsd = sw.full_state_dict(model)
    for n, p in model.named_parameters():
        assert torch.equal(fsd[n], p.full_tensor()), n
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(sd, assign=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), fsd[n]), f"state_dict round trip: {n}"
    sw.save_checkpoint(path, model, opt, step=1)
    moments = {n: opt.state[p]["momentum_buffer"].full_tensor() for n, p in
               model.named_parameters()}
    # Plain lists: tensors would cross processes as shared memory of a rank that exits.
    return {"full": {n: t.tolist() for n, t in fsd.items()},
            "momentum": {n: t.tolist() for n, t in moments.items()}}


def load_elsewhere(rank: int, world: int, path: str, dim: int | None, want: dict[str, Any]
                   ) -> None:
    """Load the checkpoint into a model sharded another way; values must equal the saved."""
    torch.manual_seed(1)
    model = Model(2)
    shard_blocks(dim)(model, sw.fully_shard)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = batch(0, world)[rank * PER_RANK:(rank + 1) * PER_RANK]
    loss_of(model, ids).backward()
    opt.step()  # momentum state exists, with other values
    opt.zero_grad()
    sw.load_checkpoint(path, model, opt)
    want = {k: {n: torch.tensor(v) for n, v in d.items()} for k, d in want.items()}
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), want["full"][n]), f"param {n}"
        got = opt.state[p]["momentum_buffer"].full_tensor()
        assert torch.equal(got, want["momentum"][n]), f"momentum {n}"
    export = path + ".safetensors"
    sw.export_safetensors(export, model)
    if rank == 0:
        from safetensors.torch import load_file
        flat = load_file(export)
        for n, t in want["full"].items():
            assert torch.equal(flat[n], t), f"export {n}"
    C.barrier()


def bad_placement(rank: int, world: int) -> list[str]:
    """Errors up front, before any collective."""
    msgs = []
    for fn in (lambda p: Shard(3), lambda p: "Shard(1)"):
        try:
            sw.fully_shard(Model(2).blocks[0], shard_placement_fn=fn)
        except ValueError as e:
            msgs.append(str(e))
    return msgs
