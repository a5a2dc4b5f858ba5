"""shardwise: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch."""

from __future__ import annotations

from . import _worker  # noqa: F401  (first: see its docstring)

# [Note: lazy package] Importing any `shardwise.x` module runs this file first. It used to
# import the whole public API (the engine, DTensor's ops, torch._dynamo through the planner:
# 3 s on an idle 2-core machine, 27 s on a busy one), so every command paid for it, even
# `export`, `generate` and the `train` launcher, which use little of it. The names now load
# on first access (PEP 562: `import shardwise as sw; sw.shard_model(...)` is unchanged) from
# _api.py, which lists them.
__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "FullyShardedDataParallel",
    "LoadResult",
    "MixedPrecisionPolicy",
    "NF4",
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
    "patch_fsdp1",
    "patch_fsdp2",
    "patched_fsdp1",
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


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import _api

        value = getattr(_api, name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
