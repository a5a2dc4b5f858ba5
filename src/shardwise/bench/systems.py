"""The systems a benchmark compares, each built the same way on the same model.

Every builder takes a freshly initialized, unsharded model (identical on every rank) and
returns (model, optimizer). The no-communication bound is the same per-rank work (forward,
backward and AdamW step of the full model on this rank's batch) with no collectives at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LR = 1e-4


def _adamw(params: object) -> torch.optim.Optimizer:
    """Every system steps with the same AdamW, in torch's fastest implementation that it
    accepts ([Note: optimizer implementation] in train/optim.py); the table names it."""
    from ..train.optim import adamw

    return adamw(params, lr=LR)[0]  # type: ignore[arg-type]


def _block_types(model: nn.Module) -> tuple[type, ...]:
    from ..engine.core.policies import find_block_classes

    return tuple(find_block_classes(model))


def build_shardwise(strategy: str) -> Callable[[nn.Module], tuple[nn.Module, object]]:
    def build(model: nn.Module) -> tuple[nn.Module, object]:
        import shardwise as sw

        sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
        return model, _adamw(model.parameters())

    return build


def build_fsdp2(model: nn.Module) -> tuple[nn.Module, object]:
    # PyTorch's own FSDP2, with the same units as shardwise: each block, then the root.
    from torch.distributed.fsdp import fully_shard

    mesh = _world_mesh(model)
    blocks = _block_types(model)
    for m in list(model.modules()):
        if isinstance(m, blocks):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _adamw(model.parameters())


def _world_mesh(model: nn.Module) -> object:
    """Every rank, on the device the model was put on. FSDP2's own default is the
    accelerator's mesh wherever one exists, which would move the CPU bench's model to a GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..engine.comm import collectives as C

    device = next(model.parameters()).device
    return init_device_mesh(device.type, (C.world_size(),))


def build_ddp(model: nn.Module) -> tuple[nn.Module, object]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    return ddp, _adamw(ddp.parameters())


def build_nocomm(model: nn.Module) -> tuple[nn.Module, object]:
    return model, _adamw(model.parameters())


SYSTEMS: dict[str, Callable[[nn.Module], tuple[nn.Module, object]]] = {
    "shardwise FULL_SHARD": build_shardwise("FULL_SHARD"),
    "shardwise SHARD_GRAD_OP": build_shardwise("SHARD_GRAD_OP"),
    "shardwise NO_SHARD": build_shardwise("NO_SHARD"),
    "torch FSDP2": build_fsdp2,
    "torch DDP": build_ddp,
    "no-comm bound": build_nocomm,
}
REFERENCE = "shardwise FULL_SHARD"


def model_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters + gradients + optimizer state this rank holds (local tensors)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2) -> shard

    total = 0
    for p in model.parameters():
        lp = local(p)
        total += lp.numel() * lp.element_size()
        if p.grad is not None:
            g = local(p.grad)
            total += g.numel() * g.element_size()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                lv = local(v)
                total += lv.numel() * lv.element_size()
    return total
