"""Issue 15: FSDP x tensor parallelism against an unsharded single-process reference.

A tiny language model with tied embedding and head, two blocks of attention (q/k/v
colwise, o rowwise) and an MLP (w1 colwise, w2 rowwise), the Megatron plan. The ranks of one
TP group see the same samples; each dp rank its own slice of one global batch, which the
reference sees whole. Sizes are chosen so that dp splits some rows unevenly (vocab 11).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import shardwise as sw
from shardwise.engine import collectives as C

VOCAB, DIM, HEADS, HIDDEN, SEQ = 11, 8, 4, 12, 5
PER_RANK = 2
TOL = 1e-5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.head_dim = DIM // HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under TP each rank holds HEADS / tp of them.
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (B, h, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(DIM), Attention(), \
            nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
        "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}


def build(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_mesh(dp: int, tp: int, hybrid: bool = False) -> DeviceMesh:
    if hybrid:  # HSDP x TP: dp = (replicate, shard)
        return init_device_mesh("cpu", (dp, 1, tp), mesh_dim_names=("rep", "shard", "tp"))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    return mesh[("rep", "shard")] if "rep" in names else mesh["dp"]


def parallelize(model: TinyLM, mesh: DeviceMesh) -> TinyLM:
    """The recipe: TP on each block, then fully_shard per block and on the root."""
    dp = dp_mesh_of(mesh)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], PLAN)
        sw.fully_shard(b, mesh=dp)
    return sw.fully_shard(model, mesh=dp)


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def dp_index(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's dp index, dp size): ranks of one TP group share it."""
    names = mesh.mesh_dim_names or ()
    if "rep" in names:
        r, s = mesh.get_local_rank("rep"), mesh.get_local_rank("shard")
        S = mesh.size(1)
        return r * S + s, mesh.size(0) * S
    return mesh.get_local_rank("dp"), mesh.size(0)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_both(model: nn.Module, ref: nn.Module, mesh: DeviceMesh, steps: int, what: str,
               start: int = 0, opt_state: tuple | None = None) -> dict[str, float]:
    """`steps` AdamW steps with clipping on both; the worst loss and norm differences."""
    opt, ref_opt = opt_state or (
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4),
        torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4))
    i, n = dp_index(mesh)
    worst = {"loss": 0.0, "norm": 0.0}
    for step in range(start, start + steps):
        x, y = batch(step, PER_RANK * n)
        mine = slice(i * PER_RANK, (i + 1) * PER_RANK)
        out = loss_of(model, x[mine], y[mine])
        out.backward()
        ref_out = loss_of(ref, x, y)
        ref_out.backward()
        got = out.detach().double().reshape(1)
        C.all_reduce(got, None)
        got = got.item() / C.world_size()  # TP ranks repeat their dp rank's loss
        d = abs(got - ref_out.item())
        worst["loss"] = max(worst["loss"], d)
        assert d <= TOL, f"{what} step {step}: loss {got} vs {ref_out.item()}"
        # Both clippers, alternating: ours and PyTorch's on the DTensor parameters.
        if step % 2 == 0:
            norm = sw.clip_grad_norm_(model, 0.5)
        else:
            norm = full(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5))
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert ref_norm > 0.5, "the test must clip"
        d = abs(norm.item() - ref_norm.item())
        worst["norm"] = max(worst["norm"], d)
        assert d <= TOL, f"{what} step {step}: grad norm {norm.item()} vs {ref_norm.item()}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return worst


def compare_params(model: nn.Module, ref: nn.Module, what: str) -> float:
    """Full parameters two ways: sw.full_state_dict and each DTensor's full_tensor()."""
    got = sw.full_state_dict(model)
    worst = 0.0
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        for how, value in (("full_state_dict", got[name]), ("full_tensor", full(mine[name]))):
            d = (value.detach().float() - p.detach().float()).abs().max().item()
            worst = max(worst, d)
            assert d <= TOL, f"{what}: {name} ({how}) differs by {d:.3g}"
    return worst


def parity(rank: int, world: int, dp: int, tp: int, hybrid: bool = False) -> dict[str, float]:
    mesh = make_mesh(dp, tp, hybrid)
    model = build()
    ref = copy.deepcopy(model)
    parallelize(model, mesh)
    what = f"dp {dp} x tp {tp}{' (HSDP)' if hybrid else ''}"
    # Every parameter is a DTensor on the one (dp, tp) mesh.
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == (3 if hybrid else 2), name
    worst = train_both(model, ref, mesh, 3, what)
    worst["params"] = compare_params(model, ref, what)
    return worst
