"""A unit's flat layout per communication dtype (`FlatBucket`) and a gather in flight.

One all-gather and one reduction per bucket move all of its parameters ([Note: layout] in
sharded_param.py for one parameter's rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.work import Work
from .sharded_param import ShardedParam


@dataclass
class FlatBucket:
    """Parameters of a unit that share a communication dtype, and their flat layout."""

    dtype: torch.dtype
    params: list[ShardedParam]
    # Gathered through this bucket's flat chunk: all but the extension parameters, which
    # the unit gathers by their hooks ([Note: all-gather extensions]); they reduce here.
    gathered: list[ShardedParam] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # into one rank's all-gather chunk
    numel: int = 0  # one rank's chunk
    grad_params: list[ShardedParam] = field(default_factory=list)
    grad_offsets: list[int] = field(default_factory=list)
    grad_numel: int = 0
    sizes: list[int] = field(default_factory=list)  # each gathered parameter's chunk

    # The reduction's "has a gradient" flags when every parameter has one, per reduce dtype
    # (made once per layout: the bucket is rebuilt when the layout changes).
    _all_flags: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def all_flags(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ones = self._all_flags.get(dtype)
        if ones is None:
            ones = self._all_flags[dtype] = torch.ones(len(self.grad_params), dtype=dtype,
                                                       device=device)
        return ones

    def __post_init__(self) -> None:
        for p in self.params:
            if p.ext is None:
                self.gathered.append(p)
                self.sizes.append(p.chunk_numel)
                self.offsets.append(self.numel)
                self.numel += p.chunk_numel
            if p.requires_grad:
                self.grad_params.append(p)
                self.grad_offsets.append(self.grad_numel)
                self.grad_numel += p.chunk_numel


@dataclass
class PendingGather:
    bucket: FlatBucket
    send: torch.Tensor  # pooled; given back once the gather is waited for
    out: torch.Tensor  # the rank-major output
    work: Work
    start: float
    blocked: float = 0.0  # seconds a synchronous all-gather held the caller inside the call
    # CUDA: an event after the all-gather on its own stream ([Note: streams]); None on CPU.
    done: Any = None
