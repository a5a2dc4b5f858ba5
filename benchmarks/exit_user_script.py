"""A minimal user script with no teardown call: what README's "Ten lines" does, then it ends.

Launched by benchmarks/exit_stress.py (and a handful of times by the test suite) under
`torchrun --standalone --nproc-per-node N`. It shards a small transformer-shaped model,
trains 3 steps (prefetching all-gathers, async reduce-scatters), saves one checkpoint, takes
one full state dict, and simply returns: no destroy_process_group, no shardwise teardown.
Argument: the checkpoint folder (one per launch).
"""

from __future__ import annotations

import os
import sys

import torch
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


class Net(nn.Module):
    def __init__(self, d: int = 33, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


rank, world, device = sw.init_distributed()
torch.manual_seed(0)
tp = int(os.environ.get("SW_EXIT_TP", "1"))
if tp > 1:
    # The trainer's GPT with its tensor-parallel plan on a (dp, tp) mesh: TP collectives in
    # forward, backward, the state dict and the checkpoint.
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.train.model import GPT, GPTConfig
    from shardwise.train.tensor_parallel import parallelize_gpt

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = GPT(GPTConfig(vocab_size=7, block_size=8, n_layer=2, n_head=4, d_model=32))
    parallelize_gpt(model, mesh["tp"])
    sw.shard_model(model, mesh=mesh["dp"])
else:
    model = sw.shard_model(Net(), sharding_strategy="FULL_SHARD",
                           auto_wrap_policy=sw.transformer_policy({Block}))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(1 + rank)
for _ in range(3):
    if tp > 1:
        idx = torch.randint(0, 7, (2, 8), generator=torch.Generator().manual_seed(rank // tp))
        loss = model(idx, idx)
    else:
        x, y = torch.randn(8, 33), torch.randint(0, 7, (8,))
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    sw.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
sw.save_checkpoint(sys.argv[1], model, opt, step=3)
state = sw.full_state_dict(model)
assert tp > 1 or len(state) == 26, sorted(state)
fail_rank = int(os.environ.get("SW_EXIT_FAIL_RANK", "-1"))
if rank == fail_rank:
    # The suite's check that a failing rank exits promptly with its own status.
    if os.environ.get("SW_EXIT_MODE") == "sys_exit":
        # A handled error: the script reports it and exits 1, while its peers are already
        # inside the next collective, which this rank will never join.
        print(f"rank {rank} exits 1 on purpose", file=sys.stderr, flush=True)
        sys.exit(1)
    raise RuntimeError(f"rank {rank} fails on purpose")
if fail_rank >= 0 and os.environ.get("SW_EXIT_MODE") == "sys_exit":
    sw.full_state_dict(model)  # a collective the failed rank never joins
