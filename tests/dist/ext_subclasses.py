"""A tensor subclass that implements FSDP2's all-gather extension, for the extension tests.

`SplitTensor` wraps a float32 tensor and gathers it as two inputs of different dtypes: its
bfloat16 rounding and the float32 remainder. Their sum is the original value exactly, so a
model of SplitTensor weights trains to the same numbers as plain weights, while the gather
exercises what the contract asks of an engine: several inputs per parameter, mixed dtypes
packed as bytes, metadata handed from pre to post, padding of uneven shards (the
5-argument hook pads to the padded shard size), the cast to `param_dtype`, and the `out=`
refresh on later gathers. The legacy `(mesh)` hook is `LegacySplitTensor`'s.

Every call of the hooks is counted per process, so tests can tell that the engine ran them.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

CALLS: Counter[str] = Counter()
META = "split-v1"


class SplitTensor(torch.Tensor):
    """A float32 tensor whose FSDP2 all-gather moves (bf16 high part, fp32 remainder)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> SplitTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kind = cls
        out = func(*pytree.tree_map_only(SplitTensor, lambda x: x._data, args),
                   **pytree.tree_map_only(SplitTensor, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, lambda x: kind(x), out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size: Any, outer_stride: Any) -> Any:
        return SplitTensor(inner["_data"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data})"

    def _inputs(self, padded_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._data
        if padded_rows is not None and data.shape[0] != padded_rows:
            full = data.new_zeros((padded_rows, *data.shape[1:]))
            full[: data.shape[0]].copy_(data)
            data = full
        hi = data.to(torch.bfloat16)
        return hi, data - hi.float()

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: Any,
                            module: nn.Module, mp_policy: Any) -> tuple[tuple, Any]:
        CALLS["pre5"] += 1
        assert isinstance(module, nn.Module) and mesh.ndim == 1, (module, mesh)
        rows = math.ceil(outer_size[0] / mesh.size())
        return self._inputs(rows), (META, tuple(outer_size))

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> Any:
        CALLS["post_out" if out is not None else "post"] += 1
        assert metadata[0] == META, metadata
        hi, lo = outputs
        assert hi.dtype == torch.bfloat16 and lo.dtype == torch.float32, (hi.dtype, lo.dtype)
        full = (hi.float() + lo).to(param_dtype)
        if out is not None:
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(full[: out.shape[0]])
            return None
        return full, (hi, lo, full)


class LegacySplitTensor(SplitTensor):
    """The same gather through the legacy one-argument hook (even shards only)."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple, Any]:  # type: ignore[override]
        CALLS["pre1"] += 1
        return self._inputs(None), (META, None)


def split_weights(model: nn.Module, legacy: bool = False) -> nn.Module:
    """Every Linear weight of `model` as a SplitTensor parameter (biases stay plain)."""
    cls = LegacySplitTensor if legacy else SplitTensor
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(cls(m.weight.detach().clone()))
    return model


# DCP reads tensors back with torch.load(weights_only=True), as torchao allowlists its own.
torch.serialization.add_safe_globals([SplitTensor, LegacySplitTensor])
