"""A small recorded run folder, as `shardwise train` writes it, for the replay tests.

Two ranks, per-layer units "0" and "2" under the root "", FULL_SHARD: per step each unit is
gathered for forward, resharded, gathered again for backward and its gradients
reduce-scattered. Times are made up but ordered like the engine's; the schema is the one
in engine/core/events.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.engine.core.events import Event

UNITS = {"0": 2176, "2": 528}  # all-gather output bytes per unit (fp32, 2 ranks)
STEPS = (1, 2, 3)


def step_events(rank: int, step: int, t: float) -> list[Event]:
    evs: list[Event] = []

    def add(unit: str, phase: str, coll: str, nbytes: int, dt: float) -> None:
        nonlocal t
        evs.append(Event(rank, unit, phase, coll, nbytes, t, t + dt, step))
        t += dt

    add("", "forward", "", 0, 0.0001)
    for u, nbytes in UNITS.items():
        add(u, "all_gather", "all_gather", nbytes, 0.002)
        add(u, "forward", "", 0, 0.001)
        add(u, "reshard", "", 0, 0.00001)
    for u, nbytes in reversed(UNITS.items()):
        add(u, "all_gather", "all_gather", nbytes, 0.002)
        add(u, "backward", "", 0, 0.002)
        add(u, "reshard", "", 0, 0.00001)
        add(u, "reduce_scatter", "reduce_scatter", nbytes, 0.003)
    return evs


def write_run(path: Path) -> Path:
    path.mkdir(parents=True)
    for rank in (0, 1):
        lines = []
        for step in STEPS:
            events = step_events(rank, step, 100.0 + 0.025 * step)  # steps 25 ms apart
            lines += [json.dumps(e.to_dict()) for e in events]
        # A run killed mid-write leaves half a line behind: replay must skip it.
        (path / f"events-rank{rank}.jsonl").write_text("\n".join(lines) + '\n{"rank": 0, "un')
    metrics = [{"step": s, "loss": 3.0 - 0.5 * s, "lr": 1e-3, "grad_norm": 1.0,
                "tokens_per_s": 1000.0, "memory_mb": [300.0 + s, 301.0 + s], "time_s": s}
               for s in STEPS]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "config.toml").write_text('[shard]\nsharding_strategy = "FULL_SHARD"\n')
    return path
