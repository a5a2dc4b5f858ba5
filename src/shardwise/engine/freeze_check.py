"""The freeze check: every rank must agree on which parameters require grad.

[Note: freeze check] A unit's gradient reduction packs only the parameters that require
grad (unit.py, `FlatBucket.grad_params`), and the layout follows `requires_grad` changes the
user makes between steps (`Unit.follow_requires_grad`, at the root's forward). A change made
on one rank only (`blocks[0].attn.weight.requires_grad_(False)` on rank 1) thus gives the
ranks reductions of different sizes: gloo's pair transport aborted the process from its I/O
thread ("Received data size doesn't match expected size", SIGABRT), other transports hang.

The layout check (context.py) runs once, at the first forward. A freeze cannot be checked
only when it happens: a rank that changed nothing does not know that it should join a
collective. So every rank takes part in the check at every backward of a grad-enabled
forward, where all of them already are at the same point of the step:

- `start` (the root's forward, after the layout has followed `requires_grad`): a CRC of
  every parameter's flag is taken. A forward that no backward follows goes no further:
  nothing reduces, nothing can mismatch.
- `issue` (the first backward hook, before any backward collective): the CRC goes into one
  asynchronous MAX all-reduce of (fp, -fp) over the model's ranks, the group of the layout
  check (`C.same_on_all_async`; the world unless the model runs on a subgroup, [Note: model
  group] in mesh.py, where a mesh of several dims adds one synchronous all-reduce per
  further dim at `settle`). The flags of the hooked agreement ride in it, one per unit
  ([Note: hooked agreement] in schedule_lockstep.py): the schedule needs them in backward.
- `settle` (where the schedule first needs that agreement: after the backward of the head
  and the last block, always before any reduction, at the same place in every rank's
  collectives; or the next forward, when the backward never got there): wait for it.
  Every rank reads the same result, so either all go on or all raise. On a mismatch one
  more exchange (every rank's flags, on the error path only) names the units, the counts
  and the parameters that differ, in the RuntimeError, and the backward is abandoned
  (`ModelContext._settle_agreement`).
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
in benchmarks/RESULTS.md, "Freeze check"), when the check was issued at the forward's start
and waited for at the first backward hook, before the one-copy exchange: the check's own
host time is 0.15 ms per step (median; 4 units of Linear(64, 64)) to 0.3 ms (GPT 'small'),
of which about 0.12 ms is gloo's own call that issues the all-reduce; the wait found the
result there (0.02-0.05 ms). The step-time differences (+0.1 ms of 11.7 ms; -0.7 to +0.25 ms
of 24 ms; -1.1 to -1.9 ms of 172 ms) were within the noise of this machine; a synchronous
check would add a round trip (0.4 ms median here) to every step instead.

Issued at the first backward hook with the hooked flags (same benchmark, mlp, load 3-4.4,
6 runs taking turns with runs of the code before this change): the check's host time is
0.18-0.44 ms per step (median, issue included), the wait 0.03-0.06 ms (the result is
there). With the one-copy exchange the check costs more than the figures above on both
sides: +0.4 to +1.4 ms of 5-17 ms per step before, +0.7 to +1.3 ms after in four runs and
+3.1 to +4.8 ms in two. A scratch A/B in one pair of processes (not kept), steps taking
turns between no check and the check issued at the forward's start, at the first backward
hook, or after the root's pre-backward point, all waited for where the schedule needs it,
found the placements alike at load 2.3 (+0.55 to +1.1 ms of 6-8 ms), the first backward
hook 0.3-3.0 ms dearer than the forward's start at load 3.7-4.3, and on GPT 'small' no
difference above the noise (+0.2 to +2.9 ms of 135 ms). Not measured: NCCL.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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
        self._groups: Sequence[Any] = [None]
        C.let_go_at_exit(self)
        # The flags (one byte per parameter) of the forward running, read at its start and
        # not issued yet; the check in flight, with the flags it fingerprinted.
        self._flags: bytes | None = None
        self._in_flight: tuple[C.Agreement, bytes] | None = None

    def prepare(self, units: Sequence[Unit], groups: Sequence[Any] = (None,)) -> None:
        """`groups`: the model's agreement groups (mesh.agreement_groups)."""
        self._units = units
        self._groups = groups
        self.enabled = (C.is_initialized() and len(groups) > 0
                        and any(u.mesh.dp_size > 1 for u in units))

    def start(self) -> None:
        """Read the layout the forward starting now reduces with (the root's forward, grad
        enabled; after the units followed `requires_grad`); `issue` sends it."""
        if not self.enabled:
            return
        self.settle()  # the previous forward's, if nothing took it yet
        self._flags = bytes(p.requires_grad for u in self._units for p in u.params)

    def issue(self, hooked: Sequence[bool]) -> bool:
        """The forward's backward begins: issue the check of the layout `start` read, with
        `hooked` (per unit: its outputs carry a pre-backward hook on this rank) riding in the
        same all-reduce ([Note: hooked agreement] in schedule_lockstep.py). False when
        nothing was issued (nothing to agree, no grad-enabled start, or issued already)."""
        flags, self._flags = self._flags, None
        if flags is None:
            return False
        self._in_flight = (C.same_on_all_async(zlib.crc32(flags), self._groups[0], label=LABEL,
                                               extra=[int(h) for h in hooked]), flags)
        return True

    def settle(self) -> list[int] | None:
        """Wait for the check in flight; raise on every rank if the ranks disagree. Returns
        the OR over the ranks of the `hooked` flags it carried (None: none in flight)."""
        if self._in_flight is None:
            return None
        agreement, flags = self._in_flight
        self._in_flight = None
        agreed = agreement.wait()
        hooked = agreement.extra()
        if len(self._groups) > 1:  # the further dims of the model's mesh, in turn
            hi, neg_lo, *hooked = C.max_over([int(x) for x in agreement.host.tolist()],
                                             self._groups[1:], label=LABEL)
            agreed = (hi, -neg_lo) == (agreement.value, agreement.value)
        if not agreed:
            # Every rank read the same result: all of them are here, on the error path.
            raise RuntimeError(self._describe(flags))
        return hooked

    def let_go(self) -> None:
        """At exit: drop the check in flight unwaited (nothing will settle it now)."""
        self._in_flight = self._flags = None

    def drain(self) -> None:
        """Wait for the check in flight and drop it (after a failed step)."""
        self._flags = None  # read by a forward that raised before its end: never issued
        if self._in_flight is not None:
            agreement, _ = self._in_flight
            self._in_flight = None
            agreement.wait()

    def _describe(self, flags: bytes) -> str:
        group = self._groups[0]  # ranks that differ in another dim show no difference here
        every = C.all_gather_bytes(flags, group)
        names = C.group_ranks(group)
        me, fp = C.rank(), zlib.crc32(flags)
        others = sorted({zlib.crc32(b) for b in every} - {fp})
        parts = []
        at = 0
        for u in self._units:
            n = len(u.params)
            rows = [b[at: at + n] for b in every]
            at += n
            if len(set(rows)) > 1:
                parts.append(_unit_difference(u, rows, names))
        where = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more units"
                                         if len(parts) > 3 else "")
        return (f"rank {me}: ranks disagree on which parameters require grad (fingerprint "
                f"{fp} here, {', '.join(map(str, others))} elsewhere); {where}. Freeze "
                "or unfreeze parameters on every rank alike, between steps: a unit reduces "
                "the gradients of the parameters that require grad, so ranks that disagree "
                "would exchange buffers of different sizes")


def _unit_difference(u: Unit, rows: list[bytes], names: list[int]) -> str:
    """"unit 'blocks.1' (7 parameters): rank 1 trains 6, rank 0 trains 7; blocks.1.up.weight
    requires grad on rank 0, not on rank 1" (`rows`: each rank's flags for `u`, from the
    global ranks `names`)."""
    by_count: dict[int, list[int]] = {}
    for r, row in zip(names, rows):
        by_count.setdefault(sum(row), []).append(r)
    # The fewest ranks first: usually the one rank that changed something.
    counts = sorted(by_count.items(), key=lambda kv: (len(kv[1]), kv[0]))
    trains = ", ".join(f"{_ranks(rs)} {'trains' if len(rs) == 1 else 'train'} {c}"
                       for c, rs in counts)
    params = []
    for i, p in enumerate(u.params):
        yes = [r for r, row in zip(names, rows) if row[i]]
        if 0 < len(yes) < len(rows):
            no = [r for r in names if r not in yes]
            name = f"{u.name}.{p.fqn}" if u.name else p.fqn
            params.append(f"{name} requires grad on {_ranks(yes)}, not on {_ranks(no)}")
    more = f" (and {len(params) - 5} more)" if len(params) > 5 else ""
    return (f"unit {u.label!r} ({len(u.params)} parameters): {trains}; "
            + ", ".join(params[:5]) + more)


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"
