"""The public API's imports, loaded on first use of a `shardwise.<name>` ([Note: lazy
package] in __init__.py). Every name here is in `shardwise.__all__` (a test checks both ways)."""
# ruff: noqa: F401

from __future__ import annotations

from .checkpoint.adapter import save_adapter
from .checkpoint.export import export_safetensors
from .checkpoint.manifest import CheckpointError
from .checkpoint.pretrained import LoadResult, load_pretrained
from .checkpoint.quantize import NF4
from .checkpoint.sharded import load_checkpoint, save_checkpoint
from .checkpoint.state_dict import full_state_dict, load_full_state_dict
from .engine.api.fully_shard import fully_shard, shard_model
from .engine.api.sharded_module import ShardedModule, UnshardHandle, no_sync
from .engine.api.state import ShardwiseState, register_fsdp_forward_method, share_comm_ctx
from .engine.comm.process_group import init_distributed
from .engine.comm.work import CollectiveError, CollectiveMismatchError, set_debug
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
from .fsdp1 import FullyShardedDataParallel
from .fsdp1_patch import patch_fsdp1, patched_fsdp1
from .fsdp2_patch import patch_fsdp2, patched_fsdp2
from .observe.overlap import OverlapReport
from .observe.trace import Trace, trace
from .planner import Plan, plan
