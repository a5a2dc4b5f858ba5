"""Where a FULL_SHARD step waits: the communication each rank's training thread was blocked on.

    .venv/bin/python benchmarks/exposed_waits.py bench30m 6 2

Arguments: preset, steps (the first is a warm-up), sequences per rank. Two gloo ranks train
the benchmark's shardwise FULL_SHARD system (shardwise.bench.systems) with an event sink on
the model (engine/core/events.py: each collective's `wait` is the time the calling thread was
blocked in it); prints each rank's median step and its exposed waits per step, by
collective. On gloo a reduction's local sum (all-to-all, then a sum) runs inside its wait,
so the reduce-scatter figure includes that sum. "release" is the time builds before issue
35 waited, before freeing what they had sent, for the peer to have read it (the one-copy
exchange, since removed): counted by timing `Work.wait_sent` where it exists.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from shardwise.testing import run_distributed


def _worker(rank: int, world: int, preset: str, steps: int,
            batch: int) -> list[tuple[float, dict[str, float]]]:
    from shardwise.bench.runner import make_config
    from shardwise.bench.systems import SYSTEMS
    from shardwise.engine.comm.work import Work
    from shardwise.engine.core.context import context_of
    from shardwise.engine.core.events import Event
    from shardwise.train.model import GPT

    torch.set_num_threads(1)
    cfg = make_config(preset, 128)
    torch.manual_seed(0)
    model, opt = SYSTEMS["shardwise FULL_SHARD"](GPT(cfg))
    ctx = context_of(model)
    assert ctx is not None
    events: list[Event] = []
    ctx.sinks.append(events.append)
    released = [0.0]
    wait_sent = getattr(Work, "wait_sent", None)
    if wait_sent is not None:  # only builds that had the one-copy exchange (before issue 35)
        def timed(self: Work) -> None:
            t = time.perf_counter()
            wait_sent(self)
            released[0] += time.perf_counter() - t

        Work.wait_sent = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (batch, 128), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, 128), generator=g)
    out = []
    for _ in range(steps):
        events.clear()
        released[0] = 0.0
        t0 = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - t0
        waits: dict[str, float] = {}
        for e in events:
            if e.collective:
                waits[e.collective] = waits.get(e.collective, 0.0) + e.wait
        if wait_sent is not None:
            waits["release"] = released[0]
        out.append((seconds, waits))
    return out[1:]


def main() -> None:
    preset, steps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for rank, rows in enumerate(run_distributed(_worker, 2, preset, steps, batch)):
        kinds = sorted({k for _, w in rows for k in w})
        step = statistics.median(s for s, _ in rows)
        waits = {k: statistics.median(w.get(k, 0.0) for _, w in rows) for k in kinds}
        print(f"rank {rank}: step {step * 1e3:.1f} ms, exposed waits per step: "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in waits.items())
              + f" (total {sum(waits.values()) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
