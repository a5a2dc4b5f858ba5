"""Issue 36: pipeline parallelism (torch.distributed.pipelining) x FSDP at 4 ranks.

A (pp 2, dp 2) mesh. A small GPT-like model is cut by hand, torchtitan's way: each stage
is a copy of the whole model with the other stages' layers deleted, so its parameter names
are the full model's. With two stages, stage 0 holds the embedding and the first half of the
blocks, stage 1 the second half, the final norm and the head; the interleaved schedule cuts
four stages of one block each, two per pp rank. Each stage's blocks and the stage root
are sharded over the stage's dp group, with shardwise or with torch's FSDP2, and the same
schedule runs on both, in the same processes, from the same weights and data. Each rank also
trains the whole model unsharded in one process on the global batch, as the reference.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Shard

from shardwise.fsdp2 import fully_shard as _sw_fully_shard
from tests.dist.collective_count_workers import counting


def sw_fully_shard(*args: Any, **kwargs: Any) -> Any:
    """Each unit alone: the parameters and gradients move as often as FSDP2's, counted
    below ([Note: coalesced units] in engine/core/schedule.py)."""
    return _sw_fully_shard(*args, coalesce_bytes=0, **kwargs)

# Odd sizes so that dp 2 splits some rows unevenly (vocab 11, width 6, hidden 19).
VOCAB, DIM, HIDDEN, SEQ, LAYERS = 11, 6, 19, 5, 4
PER_DP_RANK = 4  # sequences per dp rank per step: split into the schedule's microbatches
STEPS = 3
TOL = 1e-5
PP = 2
# name -> (schedule class, stages per pp rank). The interleaved schedule runs two stages per
# rank and brackets each stage's compute with UNSHARD / RESHARD actions (FSDPModule.unshard
# (async_op=True), the handle's wait(), reshard()).
SCHEDULES: dict[str, tuple[Any, int]] = {"gpipe": (ScheduleGPipe, 1),
                                          "1f1b": (Schedule1F1B, 1),
                                          "interleaved": (ScheduleInterleaved1F1B, 2)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 2, DIM // 2).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(DIM, dim=-1))  # (B, 2, T, 3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Any of its parts may be None: a pipeline stage is the model with the others deleted."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.pos: nn.Parameter | None = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        # A dict, not a list: deleting a stage's blocks keeps the others' names.
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            assert self.pos is not None
            x = self.embed(x) + self.pos[: x.shape[1]]  # (B, T, DIM)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)  # (B, T, VOCAB)
        return x


def stage_of(model: GPT, stage: int, n_stages: int) -> GPT:
    """An equal share of the blocks; the first stage also holds the embedding, the last
    the final norm and the head (2 stages: embedding + blocks 0-1, blocks 2-3 + head)."""
    part = copy.deepcopy(model)
    per = LAYERS // n_stages
    for name in list(part.blocks):
        if int(name) // per != stage:
            del part.blocks[name]
    if stage != 0:
        part.embed = part.pos = None
    if stage != n_stages - 1:
        part.norm = part.head = None
    return part


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (n, SEQ), generator=g),
            torch.randint(0, VOCAB, (n, SEQ), generator=g))


def shard_stage(part: GPT, dp_mesh: DeviceMesh, fully_shard: Callable[..., Any]) -> None:
    for block in part.blocks.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(part, mesh=dp_mesh)


def check_sharded(part: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Each parameter is this dp rank's dim-0 chunk."""
    for name, p in part.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (name, p)
        rows, n, r = p.shape[0], dp_mesh.size(), dp_mesh.get_local_rank()
        chunk = -(-rows // n)  # torch.chunk's: the last rank may hold fewer rows, or none
        want = max(0, min(rows, (r + 1) * chunk) - r * chunk)
        assert p.to_local().shape[0] == want, (name, p.to_local().shape, want)


def check_states(part: nn.Module, what: str) -> None:
    """What the stage's perform_reduce_grad walks: torch's `fully_shard.state(stage)` and
    its `_state_ctx.all_states`, the state of every sharded module of the stage (FSDP2 fills
    it at the first forward)."""
    modules = [m for m in part.modules() if isinstance(m, FSDPModule)]
    states = [torch_fully_shard.state(m) for m in modules]
    assert all(st is not None for st in states), (what, [type(m).__name__ for m in modules])
    walked = [id(st) for st in states[0]._state_ctx.all_states]  # from the stage root
    assert sorted(walked) == sorted(id(st) for st in states), what
    if what == "shardwise":
        assert all(st is m._get_fsdp_state() for st, m in zip(states, modules))


def full_params(part: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in part.named_parameters()}


def reference(steps: int, n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model, unsharded, one process, the global batch: losses and parameters."""
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    losses = []
    for step in range(steps):
        x, y = batch(step, n)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


Run = tuple[list[float], dict[str, torch.Tensor], Counter[str]]


def train_pipeline(mesh: DeviceMesh, fully_shard: Callable[..., Any], schedule: str,
                   n_microbatches: int, what: str) -> Run:
    """This pp rank's stages, each sharded over its dp group: the global mean loss per step
    (the same on every rank), the full parameters of this rank's stages at the end, and the
    collectives of the last schedule step by kind (the first one also infers metadata)."""
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dp = mesh["dp"].size()
    cls, per_rank = SCHEDULES[schedule]
    n_stages = PP * per_rank
    torch.manual_seed(0)
    model = GPT()
    # Stage s runs on pp rank s % PP (the interleaved schedule's loop order).
    parts = [stage_of(model, s, n_stages) for s in range(pp_rank, n_stages, PP)]
    stages = []
    for part, index in zip(parts, range(pp_rank, n_stages, PP)):
        shard_stage(part, mesh["dp"], fully_shard)
        check_sharded(part, mesh["dp"])
        stages.append(PipelineStage(part, index, n_stages, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches, loss_fn=loss_fn)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, PER_DP_RANK * dp)
        rows = slice(dp_rank * PER_DP_RANK, (dp_rank + 1) * PER_DP_RANK)
        mb_losses: list[torch.Tensor] = []
        with counting() as counts:
            # The first stage is on pp rank 0, the last on pp rank PP - 1.
            if pp_rank == 0:
                sched.step(x[rows])
            else:
                sched.step(target=y[rows], losses=mb_losses)
        opt.step()
        opt.zero_grad()
        # The last stage holds the microbatch losses; every rank gets the global mean.
        mean = torch.zeros(1, dtype=torch.float64)
        if mb_losses:
            mean += torch.stack(mb_losses).double().mean() / dp
        dist.all_reduce(mean)
        losses.append(mean.item())
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        check_states(part, what)
        full.update(full_params(part))
    return losses, full, counts["python"]


def parity(rank: int, world: int, cases: list[tuple[str, int]]
           ) -> dict[str, dict[str, Any]]:
    """Per (schedule, microbatches): shardwise against FSDP2 and both against the unsharded
    reference, losses every step and parameters after the last, to TOL; and the last step's
    collectives. Returns, per case, the worst differences and both systems' counts (shardwise
    with each unit alone, as FSDP2 moves them; coalesced units are checked for numbers)."""
    mesh = init_device_mesh("cpu", (PP, world // PP), mesh_dim_names=("pp", "dp"))
    ref_losses, ref_params = reference(STEPS, PER_DP_RANK * mesh["dp"].size())
    out: dict[str, dict[str, Any]] = {}
    for schedule, n_microbatches in cases:
        case = f"{schedule} x {n_microbatches} microbatches"
        # "coalesced": shardwise's defaults, small units sharing collectives (numbers only:
        # its counts are its own).
        runs = {what: train_pipeline(mesh, fs, schedule, n_microbatches, what)
                for what, fs in (("fsdp2", torch_fully_shard), ("shardwise", sw_fully_shard),
                                 ("coalesced", _sw_fully_shard))}
        worst: dict[str, float] = {}
        for what, (losses, params, _) in runs.items():
            d_loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
            assert d_loss <= TOL, f"{what}, {case}: losses {losses}, reference {ref_losses}"
            d_param = max((params[n] - ref_params[n]).abs().max().item() for n in params)
            assert d_param <= TOL, f"{what}, {case}: parameters differ by {d_param}"
            worst[f"{what} vs reference"] = max(d_loss, d_param)
        (sw_losses, sw_params, sw_counts), (fs_losses, fs_params, fs_counts) = (
            runs["shardwise"], runs["fsdp2"])
        assert sw_params.keys() == fs_params.keys()
        d = max([abs(a - b) for a, b in zip(sw_losses, fs_losses)]
                + [(sw_params[n] - fs_params[n]).abs().max().item() for n in sw_params])
        assert d <= TOL, f"{case}: shardwise differs from FSDP2 by {d}"
        worst["shardwise vs fsdp2"] = d
        out[case] = {"worst": worst, "shardwise": dict(sw_counts), "fsdp2": dict(fs_counts)}
    return out
