"""FSDP2's public names, from shardwise: the one-line switch for code written for FSDP2.

    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy   # FSDP2
    from shardwise.fsdp2 import fully_shard, MixedPrecisionPolicy          # shardwise

`FSDPModule` is torch's own class: shardwise's sharded modules are instances of it
([Note: FSDPModule identity], engine/api/sharded_module.py), so
`isinstance(m, FSDPModule)` checks in frameworks hold with either import. The policies are
torch's classes too (fully_shard accepts them and shardwise's own); docs/porting.md lists
every name and its status.
"""

from __future__ import annotations

from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

from .engine.api.fully_shard import fully_shard
from .engine.api.sharded_module import UnshardHandle
from .engine.api.state import register_fsdp_forward_method, share_comm_ctx

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
