"""The local copies the engine makes per gather and per reduction, in bytes, by where.

[Note: local copies] Besides the collectives, a unit's gather and reduction copy bytes on
the rank itself, on the training thread, and the engine counts them per unit
(`Unit.copied`, engine/core/unit.py; `shardwise bench` prints them). The keys are the engine's:

- gather_in: the shard into the send buffer (all-to-all: into every peer's row too);
- gather_out: the all-gather output into the unsharded parameters; on one rank, where
  nothing is gathered, the shard into the unsharded parameter unless it is direct (the
  engine makes that copy without counting it);
- pack: the gradients into the reduce buffer (every rank's row, with the flags);
- reduce_sum: the local sum of a transport that reduces on this side (not "native");
- reduce_out: reduced gradients cast into the master dtype or moved to the host.

tests/dist/test_plan.py holds `step_copies` against the engine's counts at 2 and 3 ranks,
so when the engine drops a copy the time model drops it too. They cost
`copy_seconds`: each byte written is read once (the calibrated `memory_bandwidth` counts a
copy's reads and writes).
"""

from __future__ import annotations

from ..engine.comm.transport import kind_for
from .memory import UnitCost, _size

KINDS = ("gather_in", "gather_out", "pack", "reduce_sum", "reduce_out")


def unit_copies(c: UnitCost, shard_size: int, replicate_size: int,
                transport: str) -> dict[str, int]:
    """Bytes unit `c` copies per call: gather_in and gather_out per gather, the rest per
    reduction. `transport`: engine/comm/transport.py's kind for the shard group."""
    S = shard_size
    out = dict.fromkeys(KINDS, 0)
    if S > 1:
        for dtype, chunk in c.gather:
            size = _size(dtype)
            out["gather_in"] += chunk * size * (S if transport == "all_to_all" else 1)
            out["gather_out"] += S * chunk * size
    elif not c.direct:
        out["gather_out"] = c.unsharded_bytes
    # One rank with direct parameters reduces nothing: its gradients are the result.
    if c.reduce and not (S * replicate_size == 1 and c.direct):
        for rdtype, n, _ in c.reduce:
            size = _size(rdtype)
            out["pack"] += n * S * size
            if S > 1 and transport != "native":
                out["reduce_sum"] += n * size
        out["reduce_out"] = c.cast_grad_bytes
    return out


def transport_of(shard_size: int, gloo: bool) -> str:
    """The engine's transport for a shard group (gloo: the device's `collective_scratch`)."""
    return kind_for(gloo, shard_size) if shard_size > 1 else "native"


def gathers_per_step(i: int, reshard_after_forward: bool) -> int:
    """All-gathers unit `i` (0: the root) makes per step: forward, and backward again when
    it resharded after forward (never the root: it keeps its parameters)."""
    return 2 if reshard_after_forward and i != 0 else 1


def step_copies(costs: list[UnitCost], *, shard_size: int, replicate_size: int,
                transport: str, reshard_after_forward: bool) -> dict[str, int]:
    """Bytes copied locally per training step (every unit gathers and reduces), by where."""
    total = dict.fromkeys(KINDS, 0)
    for i, c in enumerate(costs):
        per = unit_copies(c, shard_size, replicate_size, transport)
        n = gathers_per_step(i, reshard_after_forward)
        for k in KINDS:
            total[k] += per[k] * (n if k.startswith("gather") else 1)
    return total


def copy_seconds(nbytes: int, memory_bandwidth: float) -> float:
    return 2 * nbytes / memory_bandwidth
