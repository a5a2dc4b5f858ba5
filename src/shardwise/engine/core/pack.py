"""Gradients into a unit's reduce buffer: rank-major rows, zero-padded, pre-divided.

[Note: divide in the pack] A power-of-two divide is exact, so dividing each rank's gradient
before the sum gives the same bits as after it, and costs nothing inside the pack (one pass
instead of a separate one over the reduced shard). Other factors divide after the sum.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .layout import full_into_rows

if TYPE_CHECKING:
    from .sharded_param import ShardedParam


def prescale(factor: float) -> float | None:
    """1/factor when the divide can go into the pack exactly (a power of two), else None."""
    if factor == 1 or factor <= 0 or math.frexp(factor)[0] != 0.5:
        return None
    return 1.0 / factor


def pack_grad(p: ShardedParam, grad: torch.Tensor | None, dst: torch.Tensor,
               scale: float | None = None) -> None:
    """Copy p's unsharded gradient (times `scale`) into (S, C*row_numel) rank-major rows,
    zero-padded."""
    if grad is None:
        dst.zero_()
        return
    if p.shard_dim != 0:
        # The gradient is in the parameter's own (contiguous) layout: strided copies of
        # its rows straight into the buffer, no temporary ([Note: layout]).
        full_into_rows(grad, dst, p.shard_dim, p.chunk_rows, 0, scale)
        return
    flat = grad.reshape(-1)
    chunk = p.chunk_numel
    if p.chunk_rows == 0:
        return  # dim 0 has size 0: nothing to send (and no rows to divide by)

    def put(d: torch.Tensor, src: torch.Tensor) -> None:
        torch.mul(src, scale, out=d) if scale is not None else d.copy_(src)

    full_ranks = p.dim0 // p.chunk_rows
    if full_ranks:
        put(dst[:full_ranks], flat[: full_ranks * chunk].view(full_ranks, chunk))
    tail = flat.numel() - full_ranks * chunk
    if full_ranks < dst.shape[0]:
        if tail:
            put(dst[full_ranks, :tail], flat[full_ranks * chunk :])
        dst[full_ranks, tail:].zero_()
        dst[full_ranks + 1 :].zero_()
