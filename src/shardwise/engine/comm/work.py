"""A collective in flight (`Work`), and how every collective is issued.

`issue` is the one door to torch.distributed for operations: it hands tensors over for the
exit drain ([Note: gloo teardown] in process_group.py), runs the debug-mode cross-rank check
(engine/comm/work.py) and turns a backend failure into a `CollectiveError` naming the
collective, its unit and its ranks.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import process_group as PG

# --------------------------------------------------------------------------------------------------
# Collective checks: name the divergence or the dead peer instead of hanging.
#
# [Note: collective fingerprints] With debug on (`SHARDWISE_DEBUG=1` or `sw.set_debug(True)`),
# every collective that shardwise issues is preceded by a small all-gather, on the same group,
# of this rank's fingerprint of it: the group's sequence number, the op, the unit's module path,
# the shape and the dtype. Every rank compares all fingerprints before the real collective is
# issued. Because every collective on a group is preceded by exactly one fingerprint exchange on
# that group, the k-th exchange of one rank always meets the k-th exchange of the others: ranks
# that took different paths (a unit run an extra time, a unit skipped, another branch) disagree
# at the first collective where their paths part, and all of them raise
# `CollectiveMismatchError` naming both paths and which ranks took each. Without the check the
# same mistake either hangs until the timeout or, when the sizes happen to match, silently
# exchanges the wrong tensors.
#
# The cost is one extra small synchronous collective per collective (and async prefetches
# become synchronous at issue time); see benchmarks/RESULTS.md for the measured overhead.
# Off by default: with debug off each collective pays one boolean test.
#
# Errors that the backend raises (a peer that died, or stalled past the process group's
# timeout) are re-raised by `collectives` as `CollectiveError` naming the op, the unit, the
# group's ranks and the timeout.

FINGERPRINT_BYTES = 256
_DIGEST = 16

_forced: bool | None = None
_from_env: bool | None = None
_sequence: dict[int, int] = {}


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died, stalled past the timeout, or the ranks diverged."""


class CollectiveMismatchError(CollectiveError):
    """Ranks reached different collectives at the same point (debug mode found it)."""


def set_debug(enabled: bool) -> None:
    """Turn collective fingerprint checks on or off in this process (overrides SHARDWISE_DEBUG).

    Every rank must use the same setting: the check is itself a collective.
    """
    global _forced
    if not isinstance(enabled, bool):
        raise ValueError(f"set_debug(enabled={enabled!r}): enabled must be True or False")
    _forced = enabled


def debug_enabled() -> bool:
    global _from_env
    if _forced is not None:
        return _forced
    if _from_env is None:  # read once, at the first collective: launchers set it before
        _from_env = os.environ.get("SHARDWISE_DEBUG", "") not in ("", "0")
    return _from_env


def describe(op: str, label: str, tensor: torch.Tensor | None) -> str:
    what = f"{op} for {unit_text(label)}"
    if tensor is None:
        return what
    return f"{what} (shape {tuple(tensor.shape)}, {str(tensor.dtype).replace('torch.', '')})"


def unit_text(label: str) -> str:
    if not label:
        return "no unit"
    return "the root unit" if label == "<root>" else f"unit '{label}'"


def next_sequence(group_key: int) -> int:
    _sequence[group_key] = _sequence.get(group_key, 0) + 1
    return _sequence[group_key]


def encode(seq: int, description: str) -> torch.Tensor:
    """A fixed-size fingerprint: digest of the full text, then as much text as fits."""
    full = f"#{seq} {description}".encode()
    digest = hashlib.blake2b(full, digest_size=_DIGEST).digest()
    body = full[: FINGERPRINT_BYTES - _DIGEST]
    buf = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8)
    buf[:_DIGEST] = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    buf[_DIGEST : _DIGEST + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return buf


def decode(row: torch.Tensor) -> tuple[bytes, str]:
    raw = row.cpu().numpy().tobytes()
    return raw[:_DIGEST], raw[_DIGEST:].rstrip(b"\0").decode(errors="replace")


def check(
    seq: int,
    description: str,
    exchange: Callable[[torch.Tensor], torch.Tensor],
    global_ranks: list[int],
) -> None:
    """Exchange this rank's fingerprint; raise on every rank if any rank's differs.

    `exchange` all-gathers a FINGERPRINT_BYTES uint8 tensor over the group and returns the
    (group size, FINGERPRINT_BYTES) result; `global_ranks[i]` is group rank i's global rank.
    """
    rows = exchange(encode(seq, description))
    seen: dict[bytes, tuple[str, list[int]]] = {}
    for i in range(rows.shape[0]):
        digest, text = decode(rows[i])
        seen.setdefault(digest, (text, []))[1].append(global_ranks[i])
    if len(seen) == 1:
        return
    paths = "; ".join(f"ranks {ranks} are at {text}" for text, ranks in seen.values())
    raise CollectiveMismatchError(
        f"ranks diverged at collective {seq} of the group of ranks {global_ranks}: {paths}. "
        "They took different paths through the model (a unit ran an extra time, a unit was "
        "skipped, or a data-dependent branch differed); every rank must run the same units "
        "in the same order."
    )


# Messages of the errors gloo and NCCL raise when a peer is gone or too slow.
_COMM_FAILURE_WORDS = ("timed out", "timeout", "connection", "closed", "reset by peer",
                       "broken pipe", "abort", "unreachable", "nccl error")


def is_comm_failure(e: BaseException) -> bool:
    """Whether a backend exception means a dead, stalled or unreachable peer."""
    if isinstance(e, CollectiveError):
        return False
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _COMM_FAILURE_WORDS)


def failure(description: str, seq: int | None, global_ranks: list[int],
            timeout_s: float | None, elapsed_s: float, cause: BaseException) -> CollectiveError:
    """The error for a collective the backend gave up on (dead or stalled peer)."""
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    where = f" (collective {seq} of the group)" if seq is not None else ""
    limit = (f"the timeout of {timeout_s:g} s (sw.init_distributed(timeout_s=...) or "
             "SHARDWISE_TIMEOUT)") if timeout_s else "the process group's timeout"
    hint = "" if debug_enabled() else (
        " If the ranks may have diverged, rerun with SHARDWISE_DEBUG=1 to name where.")
    # Who stopped first and why, when a peer said so before leaving ([Note: stopping
    # together] in process_group.py): then the socket error is only the consequence.
    note = PG.stop_note()
    if note:
        return CollectiveError(f"{description} on ranks {global_ranks}{where} failed after "
                               f"{elapsed_s:.1f} s: {note}. Backend said: {first}.")
    return CollectiveError(
        f"{description} on ranks {global_ranks}{where} failed after {elapsed_s:.1f} s: "
        f"a peer rank died, or stalled past {limit}. Backend said: {first}.{hint}"
    )

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
            if self.issued is None or not is_comm_failure(e):
                raise
            raise self.issued.failure(e) from e


class Issued(NamedTuple):
    """What a collective was, kept only to explain its failure (see engine/comm/work.py)."""

    op: str
    label: str
    group: ProcessGroup | None
    tensor: torch.Tensor | None
    seq: int | None
    start: float

    def failure(self, cause: BaseException) -> CollectiveError:
        PG.mark_failed()
        return failure(describe(self.op, self.label, self.tensor), self.seq,
                         PG.group_ranks(self.group), PG.timeout_s,
                         time.perf_counter() - self.start, cause)


def _key(group: ProcessGroup | None) -> int:
    return id(group if group is not None else dist.group.WORLD)


def issue(op: str, label: str, group: ProcessGroup | None, tensor: torch.Tensor | None,
          call: Callable[[], Any]) -> tuple[Any, Issued]:
    """Check (debug mode), then run `call`; a backend failure becomes a CollectiveError."""
    PG.communicating()
    seq = None
    if debug_enabled() and PG.is_initialized() and PG.world_size(group) > 1:
        seq = next_sequence(_key(group))
        check(seq, describe(op, label, tensor), lambda fp: _fingerprints(fp, group),
                PG.group_ranks(group))
    issued = Issued(op, label, group, tensor, seq, time.perf_counter())
    try:
        return call(), issued
    except Exception as e:
        if not is_comm_failure(e):
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
