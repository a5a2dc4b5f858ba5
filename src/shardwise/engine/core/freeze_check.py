"""The freeze check (SHARDWISE_DEBUG=1): every rank must agree on which parameters require grad.

[Note: freeze check] A unit's gradient reduction packs only the parameters that require
grad (`FlatBucket.grad_params`), and the layout follows `requires_grad` changes the user
makes between steps (`Unit.follow_requires_grad`, at the root's forward). A change made on
one rank only (`blocks[0].attn.weight.requires_grad_(False)` on rank 1) gives the ranks
reductions of different sizes: gloo aborts the process ("Received data size doesn't match
expected size"), NCCL hangs or reads garbage.

A rank that changed nothing cannot know it should check, so the check is a collective every
rank joins at every backward. That is a collective FSDP2 does not issue, so it runs only in
debug mode, with the other misuse checks (engine/comm/debug.py): at the first backward hook of a
grad-enabled forward, before any reduction, one all-reduce of a CRC of every parameter's
flag over the model's ranks. Every rank reads the same result, so either all go on or all
raise; on a mismatch one more exchange (on the error path only) names the units, counts and
parameters that differ. Without debug mode the layout check at the first forward
(context.py) still runs once; docs/debugging.md says to turn the debug mode on when a run
that freezes parameters dies in a reduce-scatter.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..comm import collectives as C

if TYPE_CHECKING:
    from .unit import Unit

LABEL = "freeze check"


def check_same_trainable(units: Sequence[Unit], groups: Sequence[Any]) -> None:
    """Raise on every rank if the ranks' `requires_grad` flags differ ([Note: freeze check]).
    `groups`: the model's agreement groups (mesh.agreement_groups)."""
    if not (C.is_initialized() and groups and any(u.mesh.dp_size > 1 for u in units)):
        return
    flags = bytes(p.requires_grad for u in units for p in u.params)
    fp = zlib.crc32(flags) & 0x7FFFFFFF
    hi, neg_lo = C.max_over([fp, -fp], groups, label=LABEL)
    if (hi, -neg_lo) != (fp, fp):
        raise RuntimeError(_describe(units, groups[0], flags))


def _describe(units: Sequence[Unit], group: Any, flags: bytes) -> str:
    every = C.all_gather_bytes(flags, group)
    names = C.group_ranks(group)
    me, fp = C.rank(), zlib.crc32(flags)
    others = sorted({zlib.crc32(b) for b in every} - {fp})
    parts = []
    at = 0
    for u in units:
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
