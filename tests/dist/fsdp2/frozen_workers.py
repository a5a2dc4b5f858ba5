"""Scenarios of upstream test_fully_shard_frozen.py: frozen and trainable parameters in the
same unit and across units, freezing/unfreezing after sharding, a frozen unit used often."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint

import shardwise as sw
from tests.dist.fsdp2.common import (
    Expect,
    check_sharded_parity,
    global_batch,
    randn,
    record_collectives,
    ref_step,
    train_parity,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.hpz import in_blocks
from tests.dist.fsdp2.models import MLP


def _freeze_weights(model: nn.Module) -> None:
    """Train biases only (BitFit)."""
    for name, p in model.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)


def mixed_requires_grad_per_group(rank: int, world: int, ex: Expect,
                                  reshard_after_forward: bool | int,
                                  activation_checkpointing: bool,
                                  freeze_after_init: bool) -> None:
    """Frozen weights and trainable biases in every unit: parity, and each unit's
    reduce-scatter carries the biases (padded chunks), never the frozen weights."""
    torch.manual_seed(42)
    dim = 11
    model = nn.Sequential(*[MLP(dim) for _ in range(3)])
    if not freeze_after_init:
        _freeze_weights(model)
    ref = copy.deepcopy(model)
    for mlp in model:
        if activation_checkpointing:
            checkpoint(mlp)
        sw.fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    sw.fully_shard(model, reshard_after_forward=reshard_after_forward)
    if freeze_after_init:
        _freeze_weights(model)
        _freeze_weights(ref)
    # Each rank's reduce-scatter output: one padded chunk of each trainable bias. shardwise
    # may append a few bookkeeping elements (per-parameter "has a gradient" flags); the check
    # is that no frozen weight travels: the smallest frozen chunk would add 11 * 44 / world.
    biases = -(-4 * dim // world) + -(-dim // world)
    frozen_chunk = min(-(-4 * dim // world) * dim, -(-dim // world) * 4 * dim)
    with record_collectives() as log:
        train_parity(rank, world, ex, model, ref, randn(8, dim), _sum, "BitFit")
    numels = sorted({rec[2] for rec in log if rec[0] == "reduce_scatter"})
    ex.true(len(numels) == 1 and biases <= numels[0] < biases + frozen_chunk,
            f"reduce-scatter output numels {numels}: expected the biases ({biases} elements) "
            f"and no frozen weight (>= {frozen_chunk} more)")


def mixed_requires_grad_across_groups(rank: int, world: int, ex: Expect,
                                      reshard_after_forward: bool | int,
                                      unfreeze_params: bool) -> None:
    """Every other Linear unit frozen after sharding, an iteration under no_grad, and
    (optionally) everything unfrozen for the last iteration, as some fine-tuning does."""
    torch.manual_seed(42)
    num_linears, dim = 6, 13
    layers: list[nn.Module] = []
    for _ in range(num_linears):
        layers += [nn.Linear(dim, dim), nn.ReLU()]
    model = nn.Sequential(*layers)
    ref = copy.deepcopy(model)
    for m in model:
        if isinstance(m, nn.Linear):
            sw.fully_shard(m, reshard_after_forward=reshard_after_forward)
    sw.fully_shard(model, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    def set_requires_grad(seq: nn.Module, requires_grad: bool) -> None:
        for i in range(0, num_linears, 2):  # linears 0, 2, 4 (modules 0, 4, 8)
            seq[2 * i].requires_grad_(requires_grad)

    set_requires_grad(model, False)
    set_requires_grad(ref, False)
    num_iters, no_grad_iter = 3, 1
    for it in range(num_iters):
        if unfreeze_params and it == num_iters - 1:
            set_requires_grad(model, True)
            set_requires_grad(ref, True)
        xs = global_batch(it, world, randn(8, dim))
        if it == no_grad_iter:
            with torch.no_grad():
                ex.close(model(xs[rank]).sum(), ref(xs[rank]).sum(), f"iter {it}: no_grad loss")
            continue
        loss = model(xs[rank]).sum()
        loss.backward()
        ex.close(loss, ref_step(ref, xs, _sum)[rank], f"iter {it}: loss")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=(it % 2 == 0))
    check_sharded_parity(ex, ref, model, rank, world, "after training")


def multi_forward_mixed_requires_grad(rank: int, world: int, ex: Expect,
                                      reshard_after_forward: bool | int) -> None:
    """A frozen and a trainable unit each used several times per forward, once under
    no_grad."""

    class MultiForwardModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_0 = nn.Linear(5, 5)
            self.layer_no_grad = nn.Linear(5, 5)
            self.layer_with_grad = nn.Linear(5, 5)
            self.layer_no_grad.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layer_0(x)
            for _ in range(3):
                x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
                with torch.no_grad():
                    x += F.relu(self.layer_with_grad(x))
            return x

    torch.manual_seed(42)
    model = MultiForwardModule()
    ref = copy.deepcopy(model)
    for m in (model.layer_0, model.layer_no_grad, model.layer_with_grad, model):
        sw.fully_shard(m, reshard_after_forward=reshard_after_forward)
    train_parity(rank, world, ex, model, ref, randn(8, 5), _sum, "multi-forward frozen")


# reshard_after_forward=2 at 4 ranks, backward gathering within 2-rank blocks (hpz.py)
mixed_requires_grad_per_group_hpz = in_blocks(mixed_requires_grad_per_group, __name__)
mixed_requires_grad_across_groups_hpz = in_blocks(mixed_requires_grad_across_groups, __name__)
multi_forward_mixed_requires_grad_hpz = in_blocks(multi_forward_mixed_requires_grad, __name__,
                                                  all_in_blocks=False)
