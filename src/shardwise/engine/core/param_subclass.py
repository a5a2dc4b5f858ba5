"""One parameter that is a tensor subclass with FSDP2's all-gather hooks (NF4, float8
weights): its shard made by the subclass's own ops, the hooks taken up as an `Extension`,
and the unsharded parameter the hooks make ([Note: all-gather extensions] in extension.py).

A mixin of `ShardedParam` (which sets the attributes declared below, and whose `_build`
makes the Parameter objects around a new shard).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import dtensor as DT
from .extension import Extension, has_hooks, is_subclass, shard_mesh_of


class SubclassShard:
    fqn: str
    direct: bool
    subclass: bool
    sharded: nn.Parameter
    unsharded: nn.Parameter
    ext: Extension | None
    _device_mesh: DeviceMesh | None
    host_device: torch.device
    shard_dim: int
    shard_rank: int
    shard_size: int
    chunk_rows: int
    rest: tuple[int, ...]
    local_rows: int

    def _subclass_shard(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's padded chunk of a subclass parameter, made by the subclass's own ops
        (FSDP2's: new_zeros of the padded size, this rank's torch.chunk copied into its
        first rows), so it stays the subclass with this rank's share of the inner data."""
        data = param.detach()
        chunks = torch.chunk(data, self.shard_size, dim=0)
        with torch.no_grad():
            padded = data.new_zeros((self.chunk_rows, *self.rest))
            if self.local_rows > 0:
                padded.narrow(0, 0, self.local_rows).copy_(chunks[self.shard_rank])
        if self.host_device != padded.device:
            padded = padded.to(self.host_device)
        return padded

    def refresh_extension(self) -> bool:
        """Take up FSDP2's all-gather hooks on the shard (a subclass's, or patched onto it
        after sharding, FSDP2's monkey-patch recipe); True when that changed."""
        hooked = has_hooks(DT.local_of(self.sharded))
        if hooked == (self.ext is not None):
            return False
        if not hooked:
            self.ext = None
            return True
        if self.shard_dim != 0:
            raise NotImplementedError(
                f"{self.fqn}: FSDP2's all-gather extension (fsdp_pre_all_gather) on a "
                f"parameter sharded on dim {self.shard_dim}: shardwise runs extensions on "
                "dim-0 shards only; shard it with Shard(0)")
        if self.direct or self._device_mesh is None:
            raise NotImplementedError(
                f"{self.fqn}: FSDP2's all-gather extension (fsdp_pre_all_gather) runs on "
                "parameters sharded on a DeviceMesh; NO_SHARD (sharding_strategy) has none: "
                "use fully_shard or FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD")
        self.ext = Extension(self, shard_mesh_of(self._device_mesh))
        return True

    def set_unsharded(self, param: nn.Parameter) -> None:
        """The unsharded parameter an extension's first post hook made."""
        param._sw_param = self
        self.unsharded = param

    def adopt_subclass_shard(self, padded: torch.Tensor) -> None:
        """Replace this rank's shard (meta or plain) with `padded`, a tensor subclass with
        FSDP2's all-gather hooks and the padded shard's shape: a frozen base quantized as it
        loads (checkpoint/quantize.py). New Parameter objects, as in `materialize`; the
        owner unit must rebuild its layout (`Unit.set_params`) before the next gather."""
        assert tuple(padded.shape) == (self.chunk_rows, *self.rest) and is_subclass(padded)
        self.subclass = True
        self._build(padded, meta=False)
