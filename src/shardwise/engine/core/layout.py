"""Which dim a parameter is sharded on: one pure rule, shared by the engine and the planner.

[Note: balanced shards] A parameter is chunked `torch.chunk`-style along its shard dim
([Note: layout]): with S ranks, C = ceil(D / S) slices each, trailing ranks short or empty.
For a dim that S does not divide, the largest shard holds C slices where the mean holds
D / S, and for D < S ranks D..S-1 hold nothing: an (8, 14336, 4096) expert tensor at 32
ranks puts one expert on each of 8 ranks and none on the other 24 (rank 0's model states
4x the mean). So by default a parameter of 3 or more dims whose dim-0 chunks leave some
rank with no rows (C * (S - 1) >= D0: fewer experts than ranks, or 8 experts at 6 ranks) is
sharded on the dim whose largest shard is smallest (the lowest such dim on ties, so dim 0
whenever it is as good as any). Everything else keeps dim 0, FSDP2's layout, so that a
merely uneven split (a (17, 3, 4, 4) conv weight at 2 ranks: 9 and 8 rows) shards exactly
as FSDP2 shards it and client code reading `to_local()` sees FSDP2's rows. An explicit
`shard_placement_fn` always wins. The planner calls the same function, so a plan and a run
agree on every rank's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def max_shard_numel(shape: Sequence[int], dim: int, group_size: int) -> int:
    """Elements of the largest shard of `shape` chunked on `dim` over `group_size` ranks."""
    if not shape:
        return 1  # a 0-d parameter: one element, on shard rank 0
    size = shape[dim]
    if size == 0:
        return 0
    return -(-size // group_size) * (math.prod(shape) // size)


def balanced_shard_dim(shape: Sequence[int], group_size: int) -> int:
    """The default shard dim of a parameter of `shape` over `group_size` ranks."""
    if len(shape) < 3 or group_size <= 1 or math.prod(shape) == 0:
        return 0
    if -(-shape[0] // group_size) * (group_size - 1) < shape[0]:
        return 0  # every rank holds dim-0 rows: FSDP2's layout, uneven or not
    best = min(range(len(shape)), key=lambda d: (max_shard_numel(shape, d, group_size), d))
    return best


def imbalance(shape: Sequence[int], dim: int, group_size: int) -> float:
    """Largest shard over the mean shard (1.0: perfectly even); 1.0 for an empty tensor."""
    numel = math.prod(shape) if shape else 1
    if numel == 0 or group_size <= 1:
        return 1.0
    return max_shard_numel(shape, dim, group_size) * group_size / numel


def to_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with its shard dim first: the engine's rows (a view; `t` itself for dim 0)."""
    return t if dim == 0 else t.movedim(dim, 0)


def from_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows back in the parameter's own dim order (a view; `t` itself for dim 0)."""
    return t if dim == 0 else t.movedim(0, dim)


def rows_into_full(rows: torch.Tensor, full: torch.Tensor, dim: int, chunk_rows: int,
                   non_blocking: bool = False) -> None:
    """Copy rank-major `rows` ((S, C * row_numel): each rank's padded chunk of
    `movedim(dim, 0)`, C = `chunk_rows`) into `full`, a tensor in the parameter's own
    layout, dropping the padding: at most two strided copies, no temporary
    ([Note: layout] in sharded_param.py)."""
    moved = to_rows(full, dim)  # (D, *rest), a view of `full`
    if chunk_rows == 0:
        return
    src = rows.view(rows.shape[0], chunk_rows, *moved.shape[1:])  # (S, C, *rest)
    whole = min(moved.shape[0] // chunk_rows, src.shape[0])  # ranks with C valid rows
    if whole:
        moved[: whole * chunk_rows].unflatten(0, (whole, chunk_rows)).copy_(
            src[:whole], non_blocking=non_blocking)
    tail = moved.shape[0] - whole * chunk_rows
    if tail and whole < src.shape[0]:
        moved[whole * chunk_rows:].copy_(src[whole, :tail], non_blocking=non_blocking)


def full_into_rows(full: torch.Tensor, rows: torch.Tensor, dim: int, chunk_rows: int,
                   first_rank: int = 0, scale: float | None = None) -> None:
    """The inverse of `rows_into_full` for ranks `first_rank ..` (as many as `rows` has):
    their chunks of `movedim(dim, 0)` of `full` (times `scale`), padding rows zero."""
    moved = to_rows(full, dim)  # (D, *rest)
    if chunk_rows == 0:
        return
    dst = rows.view(rows.shape[0], chunk_rows, *moved.shape[1:])  # (R, C, *rest)

    def put(d: torch.Tensor, s: torch.Tensor) -> None:
        torch.mul(s, scale, out=d) if scale is not None else d.copy_(s)

    lo = min(first_rank * chunk_rows, moved.shape[0])
    hi = min((first_rank + dst.shape[0]) * chunk_rows, moved.shape[0])
    whole = (hi - lo) // chunk_rows
    if whole:
        put(dst[:whole], moved[lo: lo + whole * chunk_rows].unflatten(0, (whole, chunk_rows)))
    if whole < dst.shape[0]:
        tail = hi - lo - whole * chunk_rows
        if tail:
            put(dst[whole, :tail], moved[lo + whole * chunk_rows: hi])
        dst[whole, tail:].zero_()
        dst[whole + 1:].zero_()


def shard_dim_for(param: torch.Tensor, group_size: int, tp: object | None,
                  placements: dict[int, int]) -> int:
    """The dim the engine shards `param` on: `shard_placement_fn`'s (`placements`, by id)
    when it placed it, else the balanced default; dim 0 under tensor parallelism (its
    placements compose with dim-0 shards, dtensor.py) and for tensor subclasses (all-gather
    extensions gather dim-0 chunks)."""
    explicit = placements.get(id(param))
    if tp is not None or type(param.data) is not torch.Tensor:
        if explicit not in (None, 0):
            raise NotImplementedError(
                f"Shard({explicit}) for a parameter of shape {tuple(param.shape)} that is a "
                f"{type(param.data).__name__} (tensor parallel or a tensor subclass): "
                "shardwise shards those on dim 0 only; return Shard(0) or None")
        return 0
    if explicit is not None:
        return explicit
    return balanced_shard_dim(tuple(param.shape), group_size)
