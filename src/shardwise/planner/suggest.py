"""What would fit instead: when a plan does not fit, the changes that make it fit,
cheapest first, each with the total it gives and its step time.

The changes, in the order a user would reach for them (each costs more than the last:
speed, engineering or hardware):

1. bf16 mixed precision: halves the gathered units and the activations, and runs faster;
2. activation checkpointing: keeps one tensor per block, recomputes the rest (~1/3 more
   compute);
3. a smaller micro-batch with gradient accumulation: the same tokens per optimizer step,
   in more, smaller passes;
4. tensor parallelism inside a node (2, 4, 8): every block matrix split;
5. another sharding strategy (HYBRID_SHARD, then FULL_SHARD, from one that shards less);
6. more ranks (doubling, never beyond MAX_WORLD);
7. CPU offload: model states in host memory, the optimizer on the host (slow).

Each combination of up to three is tried in order of its cost (the sum of the ranks
above), with each change at its mildest setting that still fits (the largest micro-batch,
the smallest tp, the fewest ranks). A combination that contains one already found is
skipped: only minimal changes are listed, and only ones that fit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .result import Alternative, Plan

MAX_WORLD = 16_384  # the largest job worth suggesting
MAX_SHOWN = 6


@dataclass(frozen=True)
class Change:
    name: str
    cost: int
    # Settings from the mildest to the strongest: (label, plan arguments, accumulation).
    variants: tuple[tuple[str, dict[str, Any], int], ...]


def _changes(args: dict[str, Any], p: Plan) -> list[Change]:
    out: list[Change] = []
    if p.mixed_precision == "fp32":
        out.append(Change("bf16", 1, (("bf16 mixed precision", {"mixed_precision": "bf16"},
                                       1),)))
    if not p.activation_checkpointing and p.per_rank.activations_bytes:
        out.append(Change("ac", 2, (("activation checkpointing",
                                     {"activation_checkpointing": True}, 1),)))
    b = p.batch_size or 0
    if b > 1 and p.seq_len:
        micro = [m for m in range(b - 1, 0, -1) if b % m == 0]
        out.append(Change("micro", 3, tuple(
            (f"micro-batch {m} x {b // m} accumulation steps", {"batch_size": m}, b // m)
            for m in micro)))
    if p.tensor_parallel == 1 and p.shape is not None:
        tps = [t for t in (2, 4, 8) if t <= p.ranks_per_node and p.world_size % t == 0]
        if tps:
            out.append(Change("tp", 4, tuple((f"tensor_parallel={t} (inside a node)",
                                              {"tensor_parallel": t}, 1) for t in tps)))
    strategies = {"NO_SHARD": ("HYBRID_SHARD", "FULL_SHARD"),
                  "SHARD_GRAD_OP": ("FULL_SHARD",), "HYBRID_SHARD": ("FULL_SHARD",)}
    if p.sharding_strategy in strategies:
        out.append(Change("strategy", 5, tuple(
            (s, {"sharding_strategy": s}, 1) for s in strategies[p.sharding_strategy])))
    worlds = []
    w = p.world_size * 2
    while w <= MAX_WORLD:
        worlds.append(w)
        w *= 2
    if worlds and p.sharding_strategy != "NO_SHARD":
        out.append(Change("ranks", 6, tuple((f"world_size={w:,}", {"world_size": w}, 1)
                                            for w in worlds)))
    dev = args.get("device")
    if not p.cpu_offload and p.device is not None and p.device != "cpu" and not (
            getattr(dev, "is_cpu", False)):
        out.append(Change("offload", 7, (("CPU offload", {"cpu_offload": True}, 1),)))
    return out


def alternatives(what: Any, args: dict[str, Any], p: Plan,
                 plan_one: Callable[..., Plan]) -> tuple[Alternative, ...]:
    """Minimal changes (up to three together) that make `p` fit, cheapest first."""
    changes = _changes(args, p)

    def attempt(picks: list[tuple[str, dict[str, Any], int]]) -> Plan | None:
        kw: dict[str, Any] = {}
        for _, change, _ in picks:
            kw.update(change)
        try:
            return plan_one(what, **{**args, **kw, "search_batch": False})
        except ValueError:  # e.g. HYBRID_SHARD where the node size does not divide
            return None

    combos = [c for n in (1, 2, 3) for c in itertools.combinations(changes, n)]
    combos.sort(key=lambda c: (sum(x.cost for x in c), len(c)))
    found: list[tuple[frozenset[str], Alternative]] = []
    for combo in combos:
        names = frozenset(c.name for c in combo)
        if any(f <= names for f, _ in found):
            continue  # a smaller change already fits
        strongest = [c.variants[-1] for c in combo]
        q = attempt(strongest)
        if q is None or q.fits is not True:
            continue
        picks = list(strongest)
        for i, c in enumerate(combo):  # each change at its mildest setting that fits
            for v in c.variants[:-1]:
                trial = attempt([*picks[:i], v, *picks[i + 1:]])
                if trial is not None and trial.fits is True:
                    picks[i], q = v, trial
                    break
        accum = max(v[2] for v in picks)
        step = q.time.step_s * accum if q.time is not None else None
        label = " + ".join(v[0] for v in picks)
        found.append((names, Alternative(label, q.per_rank.total_bytes, True, step)))
        if len(found) == MAX_SHOWN:
            break
    return tuple(a for _, a in found)
