"""Review workers: sw.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on an unsharded
reference, for models whose units do not all share one mesh, and for empty shards."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from tests.dist.review_path_workers import Block, sharded_with_ref

PER_RANK = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = Block(5, 7), Block(7, 3)
        self.head = nn.Linear(3, 2)
        # dim 0 of 1 < world: rank 1's shard is empty.
        self.bias2 = nn.Parameter(torch.randn(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b2(self.b1(x))) + self.bias2


def _grads(rank: int, world: int, model: nn.Module, ref: nn.Module) -> None:
    x = torch.randn(PER_RANK * world, 5, generator=torch.Generator().manual_seed(5))
    (model(x[rank * PER_RANK:(rank + 1) * PER_RANK]) ** 2).mean().backward()
    (ref(x) ** 2).mean().backward()


def mixed_meshes(rank: int, world: int, blocks_replicated: bool,
                 norm_type: float) -> tuple[float, float]:
    """Blocks on one mesh, the root on another (FSDP2 allows a mesh per fully_shard call):
    a replicated (replicate=world, shard=1) 2-D mesh and the sharded 1-D world mesh."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    rep = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    block_mesh, root_mesh = (rep, flat) if blocks_replicated else (flat, rep)
    sw.fully_shard(model.b1, mesh=block_mesh)
    sw.fully_shard(model.b2, mesh=block_mesh)
    sw.fully_shard(model, mesh=root_mesh)
    _grads(rank, world, model, ref)
    got = sw.clip_grad_norm_(model, 1e-3, norm_type=norm_type).item()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=norm_type).item()
    return got, want


def inf_norm_empty_shard(rank: int, world: int) -> tuple[float, float]:
    """norm_type=inf with a parameter whose shard is empty on some rank."""
    torch.manual_seed(0)
    model, ref = sharded_with_ref(Net())
    _grads(rank, world, model, ref)
    got = sw.clip_grad_norm_(model, 1e-3, norm_type=math.inf).item()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=math.inf).item()
    return got, want
