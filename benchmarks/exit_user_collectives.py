"""User scripts with no teardown whose last collectives are the user's own, not shardwise's.

Launched by benchmarks/exit_stress.py (`--script meta` / `--script allreduce`) and a few
times by tests/e2e/test_exit.py under `torchrun --standalone --nproc-per-node N`. Argument:
the scenario.

- `meta`: builds the model on the meta device, `shard_model`, `materialize`, then reads every
  parameter's `full_tensor()` (DTensor's own all-gather, issued by torch, not by shardwise)
  and ends. The case issue 35 saw abort in 4 of 34 launches at 2 ranks.
- `allreduce`: shards, trains 2 steps, then a plain `dist.all_reduce` of a tensor the script
  made and dropped; ends.

With SW_EXIT_TP=N (N > 1) the `meta` scenario builds the trainer's GPT on the CPU (materialize
refuses tensor-parallel parameters) with its tensor-parallel plan on a (world/N, N) mesh
instead, so the last collectives are DTensor all-gathers over both mesh dimensions' groups.
Neither scenario calls destroy_process_group.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d + 3)
        self.down = nn.Linear(4 * d + 3, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build(world: int, tp: int) -> nn.Module:
    if tp > 1:
        # materialize refuses tensor-parallel parameters (it names the fix: build on a real
        # device first), so the dp x tp form builds on the CPU, then parallelizes and shards.
        from torch.distributed.device_mesh import init_device_mesh

        from shardwise.train.model import GPT, GPTConfig
        from shardwise.train.tensor_parallel import parallelize_gpt

        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        model: nn.Module = GPT(GPTConfig(vocab_size=7, block_size=8, n_layer=2, n_head=4,
                                         d_model=32))
        parallelize_gpt(model, mesh["tp"])
        return sw.shard_model(model, mesh=mesh["dp"])
    with torch.device("meta"):
        model = nn.Sequential(*(Block(33) for _ in range(3)), nn.Linear(33, 7))
    sw.shard_model(model, auto_wrap_policy=sw.transformer_policy({Block}))
    return sw.materialize(model, seed=0)


scenario = sys.argv[1]
if scenario not in ("meta", "allreduce"):
    raise ValueError(f"unknown scenario {scenario!r}; allowed: meta, allreduce")
# Module level on purpose, as a user's script is: the model lives on into interpreter exit.
rank, world, _ = sw.init_distributed()
tp = int(os.environ.get("SW_EXIT_TP", "1"))
if scenario == "meta":
    model = build(world, tp)
    total = 0.0
    for p in model.parameters():
        # DTensor's own collective: its tensors never pass through shardwise.
        total += float(p.full_tensor().abs().sum())
    assert total > 0.0, "materialize left every parameter at zero"
else:
    model = sw.shard_model(nn.Sequential(*(Block(33) for _ in range(3))),
                           auto_wrap_policy=sw.transformer_policy({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 33)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    # The user's own last collective, on a temporary the script drops at once.
    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    assert float(t[0]) == sum(range(world)), float(t[0])
    del t
