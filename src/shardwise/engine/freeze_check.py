"""The freeze check: every rank must agree on which parameters require grad.

[Note: freeze check] A unit's gradient reduction packs only the parameters that require
grad (unit.py, `FlatBucket.grad_params`), and the layout follows `requires_grad` changes the
user makes between steps (`Unit.follow_requires_grad`, at the root's forward). A change made
on one rank only (`blocks[0].attn.weight.requires_grad_(False)` on rank 1) thus gives the
ranks reductions of different sizes: gloo's pair transport aborted the process from its I/O
thread ("Received data size doesn't match expected size", SIGABRT), other transports hang.

The layout check (context.py) runs once, at the first forward. A freeze cannot be checked
only when it happens: a rank that changed nothing does not know that it should join a
collective. So every rank takes part in the check at every forward that a backward may
follow (grad enabled), where all of them already are at the same point of the step:

- `start` (the root's forward, after the layout has followed `requires_grad`): a CRC of
  every parameter's flag goes into one asynchronous 2-element MAX all-reduce of (fp, -fp)
  over the world, the group of the layout check (`C.same_on_all_async`). It overlaps the
  forward.
- `settle` (the first backward hook, before any reduction; or the next forward, when no
  backward came): wait for it. Every rank reads the same result, so either all go on or
  all raise. On a mismatch one more exchange (every rank's flags, on the error path only)
  names the units, the counts and the parameters that differ, in the RuntimeError.
- `drain` (reset_iter_state): wait and drop it, so the collectives stay matched.

Skipped when no unit reduces over more than one rank (nothing could mismatch). On a GPU the
result reaches the host on a side stream, so the wait does not wait for the forward's
kernels (not run on a GPU yet: no multi-GPU machine was at hand).

Cheaper would be a fingerprint carried inside a collective every rank issues anyway (a word
appended to the first all-gather of the step), but those live in unit.py and transport.py,
and NO_SHARD issues no all-gather. The reduce-scatter itself cannot carry it: it is the collective
whose sizes differ.

Cost, measured with benchmarks/freeze_check.py (2 gloo ranks on a 2-core machine shared
with other jobs, load 4-6; 200 steps with and 200 without, taking turns every step; figures
in benchmarks/RESULTS.md, "Freeze check"): the check's own host time is 0.15 ms per step
(median; 4 units of Linear(64, 64)) to 0.3 ms (GPT 'small'), of which about 0.12 ms is gloo's
own call that issues the all-reduce; the wait at the first backward hook finds the result
there (0.02-0.05 ms). The step-time differences (+0.1 ms of 11.7 ms; -0.7 to +0.25 ms of
24 ms; -1.1 to -1.9 ms of 172 ms) are within the noise of this machine; a synchronous check
would add a round trip (0.4 ms median here) to every step instead.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .comm import collectives as C

if TYPE_CHECKING:
    from .unit import Unit

LABEL = "freeze check"


class FreezeCheck:
    """One model's check that every rank trains the same parameters ([Note: freeze check])."""

    def __init__(self) -> None:
        # Set at the first forward (`prepare`): False when nothing could mismatch.
        self.enabled = False
        self._units: Sequence[Unit] = ()
        C.let_go_at_exit(self)
        # The check in flight, and the flags (one byte per parameter) it fingerprinted.
        self._in_flight: tuple[C.Agreement, bytes] | None = None

    def prepare(self, units: Sequence[Unit]) -> None:
        self._units = units
        self.enabled = (C.is_initialized() and C.world_size() > 1
                        and any(u.mesh.dp_size > 1 for u in units))

    def start(self) -> None:
        """Issue the check of the current layout (the root's forward, grad enabled)."""
        if not self.enabled:
            return
        self.settle()  # the previous forward's, if nothing took it yet
        flags = bytes(p.requires_grad for u in self._units for p in u.params)
        self._in_flight = (C.same_on_all_async(zlib.crc32(flags), None, label=LABEL), flags)

    def settle(self) -> None:
        """Wait for the check in flight; raise on every rank if the ranks disagree."""
        if self._in_flight is None:
            return
        agreement, flags = self._in_flight
        self._in_flight = None
        if not agreement.wait():
            # Every rank read the same result: all of them are here, on the error path.
            raise RuntimeError(self._describe(flags))

    def let_go(self) -> None:
        """At exit: drop the check in flight unwaited (nothing will settle it now)."""
        self._in_flight = None

    def drain(self) -> None:
        """Wait for the check in flight and drop it (after a failed step)."""
        if self._in_flight is not None:
            agreement, _ = self._in_flight
            self._in_flight = None
            agreement.wait()

    def _describe(self, flags: bytes) -> str:
        every = C.all_gather_bytes(flags)
        me, fp = C.rank(), zlib.crc32(flags)
        others = sorted({zlib.crc32(b) for b in every} - {fp})
        parts = []
        at = 0
        for u in self._units:
            n = len(u.params)
            rows = [b[at: at + n] for b in every]
            at += n
            if len(set(rows)) > 1:
                parts.append(_unit_difference(u, rows))
        where = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more units"
                                         if len(parts) > 3 else "")
        return (f"rank {me}: ranks disagree on which parameters require grad (fingerprint "
                f"{fp} here, {', '.join(map(str, others))} elsewhere); {where}. Freeze "
                "or unfreeze parameters on every rank alike, between steps: a unit reduces "
                "the gradients of the parameters that require grad, so ranks that disagree "
                "would exchange buffers of different sizes")


def _unit_difference(u: Unit, rows: list[bytes]) -> str:
    """"unit 'blocks.1' (7 parameters): rank 1 trains 6, rank 0 trains 7; blocks.1.up.weight
    requires grad on rank 0, not on rank 1" (`rows`: each rank's flags for `u`)."""
    by_count: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        by_count.setdefault(sum(row), []).append(r)
    # The fewest ranks first: usually the one rank that changed something.
    counts = sorted(by_count.items(), key=lambda kv: (len(kv[1]), kv[0]))
    trains = ", ".join(f"{_ranks(rs)} {'trains' if len(rs) == 1 else 'train'} {c}"
                       for c, rs in counts)
    params = []
    for i, p in enumerate(u.params):
        yes = [r for r, row in enumerate(rows) if row[i]]
        if 0 < len(yes) < len(rows):
            no = [r for r in range(len(rows)) if r not in yes]
            name = f"{u.name}.{p.fqn}" if u.name else p.fqn
            params.append(f"{name} requires grad on {_ranks(yes)}, not on {_ranks(no)}")
    more = f" (and {len(params) - 5} more)" if len(params) > 5 else ""
    return (f"unit {u.label!r} ({len(u.params)} parameters): {trains}; "
            + ", ".join(params[:5]) + more)


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"
