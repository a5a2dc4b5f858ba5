"""The local copies the engine makes per gather and per reduction, in bytes, by where.

[Note: local copies] Besides the collectives, a unit's gather and reduction copy bytes on
the rank itself, on the training thread, and the engine counts them per unit
(`Unit.copied`, engine/unit.py; `shardwise bench` prints them). The keys are the engine's:

- gather_in: the shard into the send buffer (all-to-all: into every peer's row too);
- gather_out: the all-gather output into the unsharded parameters; on one rank, where
  nothing is gathered, the shard into the unsharded parameter unless it is direct (the
  engine makes that copy without counting it);
- pack: the gradients into the reduce buffer (every rank's row, with the flags);
- reduce_sum: the local sum of a transport that reduces on this side (not "native");
- reduce_out: reduced gradients cast into the master dtype or moved to the host.

Moving in parts ([Note: parameter messages] in engine/unit.py: two ranks on gloo), the
chunks go straight between the parameters' own storage: a gather copies only the shard into
its chunk (gather_in) and the small parameters through their pack (gather_out); a reduction
packs only the small gradients and the flags, and its local sum writes each output once
(twice with the mean's power-of-two scaling). Whether a unit moves in parts is the engine's
own rule (`gathers_in_parts`, `reduces_in_parts`), asked here of the transport's kind.

tests/dist/test_plan.py holds `step_copies` against the engine's counts at 2 and 3 ranks,
so when the engine drops a copy the time model drops it too. They cost
`copy_seconds`: each byte written is read once (the calibrated `memory_bandwidth` counts a
copy's reads and writes).
"""

from __future__ import annotations

import torch

from ..engine.comm.transport import gathers_in_parts, kind_for, reduces_in_parts
from ..engine.pack import prescale
from .memory import UnitCost, _size

KINDS = ("gather_in", "gather_out", "pack", "reduce_sum", "reduce_out")


class _Kind:
    """What the transport's rules read of a transport: its name."""

    def __init__(self, name: str) -> None:
        self.name = name


def gathers_in_parts_by(kind: str) -> bool:
    """The engine's rule (comm/transport.py) for a transport of this kind."""
    return gathers_in_parts(_Kind(kind))  # type: ignore[arg-type]


def reduces_in_parts_by(kind: str, reduce_dtype: torch.dtype,
                        grad_dtype: torch.dtype | None) -> bool:
    """The engine's rule for a reduce group whose gradients are in `grad_dtype`."""
    return reduces_in_parts(_Kind(kind), reduce_dtype,  # type: ignore[arg-type]
                            [grad_dtype or reduce_dtype])


def unit_copies(c: UnitCost, shard_size: int, replicate_size: int,
                transport: str) -> dict[str, int]:
    """Bytes unit `c` copies per call: gather_in and gather_out per gather, the rest per
    reduction. `transport`: engine/comm/transport.py's kind for the shard group."""
    S = shard_size
    out = dict.fromkeys(KINDS, 0)
    if S > 1:
        small = c.small_gather or (0,) * len(c.gather)
        for (dtype, chunk), few in zip(c.gather, small):
            size = _size(dtype)
            if gathers_in_parts_by(transport):
                # [Note: parameter messages]: the shard into its own chunk of the unsharded
                # storage; the small ones out of and into their pack.
                out["gather_in"] += chunk * size
                out["gather_out"] += 2 * few * size
            else:
                out["gather_in"] += chunk * size * (S if transport == "all_to_all" else 1)
                out["gather_out"] += S * chunk * size
    elif not c.direct:
        out["gather_out"] = c.unsharded_bytes
    # One rank with direct parameters reduces nothing: its gradients are the result.
    if c.reduce and not (S * replicate_size == 1 and c.direct):
        small = c.small_reduce or (0,) * len(c.reduce)
        grad_dtypes = c.reduce_from or (None,) * len(c.reduce)
        for (rdtype, n, _), few, gdtype in zip(c.reduce, small, grad_dtypes):
            size = _size(rdtype)
            if S > 1 and reduces_in_parts_by(transport, rdtype, gdtype):
                # The small gradients and the flags into one pack; the local sum writes the
                # output, and a power-of-two mean scales it in a second pass.
                out["pack"] += few * size
                passes = 2 if prescale(S * replicate_size) is not None else 1
                out["reduce_sum"] += passes * n * size
                continue
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
