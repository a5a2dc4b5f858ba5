"""shardwise: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch."""

from __future__ import annotations

from . import _worker  # noqa: F401  (first: see its docstring)
from .checkpoint.adapter import save_adapter
from .checkpoint.export import export_safetensors
from .checkpoint.manifest import CheckpointError
from .checkpoint.pretrained import LoadResult, load_pretrained
from .checkpoint.sharded import load_checkpoint, save_checkpoint
from .checkpoint.state_dict import full_state_dict, load_full_state_dict
from .engine.api.fully_shard import ShardedModule, fully_shard, shard_model
from .engine.api.module_api import UnshardHandle, no_sync
from .engine.api.state import ShardwiseState, register_fsdp_forward_method, share_comm_ctx
from .engine.comm.debug import CollectiveError, CollectiveMismatchError, set_debug
from .engine.comm.distributed import init_distributed
from .engine.core.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    size_policy,
    transformer_policy,
)
from .engine.ext.grad_norm import clip_grad_norm_
from .engine.ext.materialize import materialize
from .engine.ext.mixed_precision import ShardedGradScaler, precision_plan
from .fsdp2_patch import patch_fsdp2, patched_fsdp2
from .observe.overlap import OverlapReport
from .observe.trace import Trace, trace
from .planner import Plan, plan

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "LoadResult",
    "MixedPrecisionPolicy",
    "OverlapReport",
    "Plan",
    "ShardedGradScaler",
    "ShardedModule",
    "ShardingStrategy",
    "ShardwiseState",
    "Trace",
    "UnshardHandle",
    "clip_grad_norm_",
    "export_safetensors",
    "full_state_dict",
    "fully_shard",
    "init_distributed",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "materialize",
    "no_sync",
    "patch_fsdp2",
    "patched_fsdp2",
    "plan",
    "precision_plan",
    "register_fsdp_forward_method",
    "save_adapter",
    "save_checkpoint",
    "set_debug",
    "shard_model",
    "share_comm_ctx",
    "size_policy",
    "trace",
    "transformer_policy",
]
