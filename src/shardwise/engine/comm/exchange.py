"""Byte exchange between ranks: raw bytes, JSON and floats, never pickle.

Everything the package shares between ranks that is not a tensor (run folders, metrics,
verdicts, checkpoint manifests, error reports) goes through here, so it is checked by
SHARDWISE_DEBUG like any collective and can never unpickle a peer's data.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group as PG
from .work import all_gather_flat, handoff, issue


def _padded_bytes(data: bytes, group: ProcessGroup | None) -> tuple[torch.Tensor, list[int]]:
    """(this rank's bytes padded to the longest rank's, every rank's length)."""
    device = PG.byte_device(group)
    n = PG.world_size(group)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    issue("exchange bytes", "", group, mine,
          lambda: all_gather_flat(handoff(lengths), handoff(mine), group=group))
    sizes = [int(x) for x in lengths.cpu()]
    buf = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)  # gloo dislikes empty buffers
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device), sizes


def all_gather_bytes(data: bytes, group: ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (no pickling: raw bytes only)."""
    if not PG.is_initialized() or PG.world_size(group) == 1:
        return [data]
    buf, sizes = _padded_bytes(data, group)
    out = torch.empty(len(sizes) * buf.numel(), dtype=torch.uint8, device=buf.device)
    issue("all_gather bytes", "", group, buf,
          lambda: all_gather_flat(handoff(out), handoff(buf), group=group))
    rows = out.view(len(sizes), buf.numel()).cpu()
    return [rows[r, : sizes[r]].numpy().tobytes() for r in range(len(sizes))]


def gather_bytes(data: bytes, dst: int = 0, group: ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data` in rank order on group rank `dst`; [] on the other ranks."""
    if not PG.is_initialized() or PG.world_size(group) == 1:
        return [data]
    buf, sizes = _padded_bytes(data, group)
    me = PG.rank(group)
    bufs = [torch.empty_like(buf) for _ in sizes] if me == dst else None
    issue(f"gather bytes(dst={dst})", "", group, buf,
          lambda: dist.gather(handoff(buf), [handoff(b) for b in bufs] if bufs is not None
                              else None, dst=PG.global_rank_of(group, dst), group=group))
    if bufs is None:
        return []
    return [b[:n].cpu().numpy().tobytes() for b, n in zip(bufs, sizes)]


def broadcast_json(value: Any, src: int = 0, group: ProcessGroup | None = None) -> Any:
    """Group rank `src`'s JSON-serializable `value`, on every rank (JSON, never pickle)."""
    data = json.dumps(value).encode() if PG.rank(group) == src else b""
    return json.loads(all_gather_bytes(data, group)[src]) if PG.world_size(group) > 1 \
        else value


def all_gather_floats(values: list[float], group: ProcessGroup | None = None) -> list[list[float]]:
    """Each rank's list of floats, in rank order, on every rank."""
    packed = struct.pack(f"<{len(values)}d", *values)
    return [list(struct.unpack(f"<{len(b) // 8}d", b)) for b in all_gather_bytes(packed, group)]
