"""Collective checks: name the divergence or the dead peer instead of hanging.

[Note: collective fingerprints] With debug on (`SHARDWISE_DEBUG=1` or `sw.set_debug(True)`),
every collective that shardwise issues is preceded by a small all-gather, on the same group,
of this rank's fingerprint of it: the group's sequence number, the op, the unit's module path,
the shape and the dtype. Every rank compares all fingerprints before the real collective is
issued. Because every collective on a group is preceded by exactly one fingerprint exchange on
that group, the k-th exchange of one rank always meets the k-th exchange of the others: ranks
that took different paths (a unit run an extra time, a unit skipped, another branch) disagree
at the first collective where their paths part, and all of them raise
`CollectiveMismatchError` naming both paths and which ranks took each. Without the check the
same mistake either hangs until the timeout or, when the sizes happen to match, silently
exchanges the wrong tensors.

The cost is one extra small synchronous collective per collective (and async prefetches
become synchronous at issue time); see benchmarks/RESULTS.md for the measured overhead.
Off by default: with debug off each collective pays one boolean test.

Errors that the backend raises (a peer that died, or stalled past the process group's
timeout) are re-raised by `collectives` as `CollectiveError` naming the op, the unit, the
group's ranks and the timeout.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import torch

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
    return CollectiveError(
        f"{description} on ranks {global_ranks}{where} failed after {elapsed_s:.1f} s: "
        f"a peer rank died, or stalled past {limit}. Backend said: {first}.{hint}"
    )
