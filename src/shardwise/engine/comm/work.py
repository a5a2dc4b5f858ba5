"""A collective in flight (`Work`), and how every collective is issued.

`issue` is the one door to torch.distributed for operations: it hands tensors over for the
exit drain ([Note: gloo teardown] in process_group.py), runs the debug-mode cross-rank check
(engine/comm/debug.py) and turns a backend failure into a `CollectiveError` naming the
collective, its unit and its ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import debug as D
from . import process_group as PG

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Every tensor given to torch.distributed goes through this: see [Note: gloo teardown].
handoff = PG.handoff


class Work(NamedTuple):
    """A collective in flight: `handle` is None for ops that completed synchronously.

    `post`, when set, finishes the result locally once the transfer is done (the local sum
    of an all-to-all reduce-scatter); `wait()` runs it exactly where the caller waits.
    `issued` says what it was, so that a failed wait names the collective and unit.
    """

    handle: object | None
    output: torch.Tensor
    post: Callable[[], None] | None = None
    issued: Issued | None = None

    def wait(self) -> torch.Tensor:
        self._handle_wait()
        if self.post is not None:
            self.post()
        return self.output

    def _handle_wait(self) -> None:
        if self.handle is None:
            return
        try:
            self.handle.wait()  # type: ignore[attr-defined]
        except Exception as e:
            if self.issued is None or not D.is_comm_failure(e):
                raise
            raise self.issued.failure(e) from e


class Issued(NamedTuple):
    """What a collective was, kept only to explain its failure (see engine/comm/debug.py)."""

    op: str
    label: str
    group: ProcessGroup | None
    tensor: torch.Tensor | None
    seq: int | None
    start: float

    def failure(self, cause: BaseException) -> D.CollectiveError:
        PG.mark_failed()
        return D.failure(D.describe(self.op, self.label, self.tensor), self.seq,
                         PG.group_ranks(self.group), PG.timeout_s,
                         time.perf_counter() - self.start, cause)


def _key(group: ProcessGroup | None) -> int:
    return id(group if group is not None else dist.group.WORLD)


def issue(op: str, label: str, group: ProcessGroup | None, tensor: torch.Tensor | None,
          call: Callable[[], Any]) -> tuple[Any, Issued]:
    """Check (debug mode), then run `call`; a backend failure becomes a CollectiveError."""
    PG.communicating()
    seq = None
    if D.debug_enabled() and PG.is_initialized() and PG.world_size(group) > 1:
        seq = D.next_sequence(_key(group))
        D.check(seq, D.describe(op, label, tensor), lambda fp: _fingerprints(fp, group),
                PG.group_ranks(group))
    issued = Issued(op, label, group, tensor, seq, time.perf_counter())
    try:
        return call(), issued
    except Exception as e:
        if not D.is_comm_failure(e):
            raise
        raise issued.failure(e) from e


def done(handle: object, async_op: bool, output: torch.Tensor, issued: Issued,
         post: Callable[[], None] | None = None) -> Work:
    return Work(handle if async_op else None, output, post, issued)


def _fingerprints(fingerprint: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's debug fingerprint (not itself checked: that would recurse)."""
    device = PG.byte_device(group)
    mine = fingerprint.to(device)
    n = PG.world_size(group)
    out = torch.empty(n * mine.numel(), dtype=torch.uint8, device=device)
    all_gather_flat(handoff(out), handoff(mine), group=group)
    return out.view(n, -1).cpu()
