"""One explorer run as the page sees it: config, seed, step counter, history, latest step.

The session owns the `WorkerGroup` and is the only thing that talks to it; every worker
call runs in a thread under one asyncio lock, so button presses arriving together are
applied one after another and a step is never interrupted half-way. Each change bumps
`seq` and is pushed to every subscriber (the SSE streams).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

from ..engine.core.events import wire_bytes
from .caution import caution
from .problem import EXTENT, GRID, N_POINTS
from .workers import RunConfig, WorkerError, WorkerGroup, offload_support

log = logging.getLogger(__name__)

STEPS = 12
PARAM_COUNT = 16 * 32 + 32 + 32 * 4 + 4  # 676
# One unsharded replica under AdamW: fp32 params, fp32 grads, two fp32 moments per value
# plus one fp32 step counter per tensor (4 tensors).
REFERENCE_BYTES = {"params": 4 * PARAM_COUNT, "grads": 4 * PARAM_COUNT,
                   "optimizer": 8 * PARAM_COUNT + 4 * 4}

GroupFactory = Callable[[int], WorkerGroup]


def _relative(ranks: list[dict]) -> list[dict]:
    """Event times in ms from the step's first event on any rank (clocks are shared:
    perf_counter is CLOCK_MONOTONIC, the same on every process of one machine)."""
    starts = [e["start"] for r in ranks for e in r.get("events", [])]
    t0 = min(starts, default=0.0)
    for r in ranks:
        evs = sorted(r.get("events", []), key=lambda e: (e["start"], e["end"]))
        # "bytes": what the rank sent (and received alike), [Note: communication bytes].
        r["events"] = [{"unit": e["unit"], "phase": e["phase"], "collective": e["collective"],
                        "bytes": wire_bytes(e["collective"], e["bytes"], e.get("group", 0)),
                        "buffer_bytes": e["bytes"], "t0": round((e["start"] - t0) * 1e3, 3),
                        "t1": round((e["end"] - t0) * 1e3, 3), "live": e["live"]}
                       for e in evs]
        r.pop("t0", None)
    return ranks


class Session:
    def __init__(self, config: RunConfig | None = None, seed: int | None = None,
                 step_interval_s: float = 0.8,
                 group_factory: GroupFactory = WorkerGroup) -> None:
        self.config = config or RunConfig()
        self._rng = random.Random(seed)
        self.seed = self._rng.randrange(2**31)
        self.step_interval_s = step_interval_s
        self._factory = group_factory
        self.group: WorkerGroup | None = None
        self.step = 0
        self.status = "starting"
        self.error: str | None = None
        self.training = False
        self.history: list[dict] = []
        self.ranks: list[dict] = []
        self.points: list[list[float]] = []
        self.eval: dict | None = None
        self.train_loss: float | None = None
        self.seq = 0
        # Bumped each time a run is built: tells the page its panels must be redrawn even
        # when seed, step and config look the same as before.
        self.run = 0
        self._lock = asyncio.Lock()
        self._train_task: asyncio.Task | None = None
        # Set by pause() to cut the wait between two animated steps short.
        self._wake = asyncio.Event()
        self._subscribers: set[asyncio.Queue] = set()

    # --- state out --------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        cfg = self.config.to_json()
        available, reason = offload_support(self.config.world_size)
        return {
            "mode": "live", "seq": self.seq, "run": self.run, "status": self.status,
            "error": self.error,
            "training": self.training, "step": self.step, "steps": STEPS,
            "config": cfg, "seed": self.seed,
            "offload": {"available": available, "reason": reason},
            "points": self.points, "n_points": N_POINTS,
            "grid": {"n": GRID, "extent": EXTENT}, "eval": self.eval,
            "train_loss": self.train_loss, "history": self.history,
            "ranks": self.ranks, "param_count": PARAM_COUNT, "reference": REFERENCE_BYTES,
            "caution": caution(cfg),
        }

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=64)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    def end_streams(self) -> None:
        """Tell every subscriber that no more updates will come (server shutdown)."""
        for q in list(self._subscribers):
            if q.full():
                q.get_nowait()
            q.put_nowait(None)

    def _publish(self) -> None:
        self.seq += 1
        state = self.state()
        for q in list(self._subscribers):
            if q.full():  # a stalled client: drop its oldest update, keep the newest
                q.get_nowait()
            q.put_nowait(state)

    # --- worker calls (always under the lock, in a thread) ------------------------------

    async def _call(self, op: str, **args: Any) -> list[dict]:
        if self.group is None or self.group.world != self.config.world_size:
            await self._close_group()
            self.group = await asyncio.to_thread(self._factory, self.config.world_size)
        return await asyncio.to_thread(self.group.call, op, **args)

    async def _close_group(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            await asyncio.to_thread(group.close)

    def _fail(self, exc: BaseException) -> None:
        log.warning("explorer run failed: %s", exc)
        self.status, self.training = "error", False
        self.error = f"{type(exc).__name__}: {exc}"[-4000:]

    async def _setup(self) -> None:
        """Build a fresh run (data, init, sharding) for the current config and seed."""
        self.step, self.history, self.train_loss, self.error = 0, [], None, None
        self.status = "starting"
        self._publish()
        try:
            replies = await self._call("setup", config=self.config.to_json(), seed=self.seed)
        except (WorkerError, OSError, ValueError) as exc:
            await self._close_group()  # a failed group may be stuck: start clean next time
            self.ranks, self.eval = [], None
            self._fail(exc)
            self._publish()
            return
        devices = self.group.devices if self.group else []
        self.points = replies[0].pop("points", [])
        self.eval = replies[0]["eval"]
        self.ranks = _relative([{"rank": r, "device": devices[r] if r < len(devices) else "",
                                 **{k: v for k, v in rep.items() if k != "eval"}}
                                for r, rep in enumerate(replies)])
        self.run += 1
        self.history = [{"step": 0, "loss": self.eval["loss"],
                         "accuracy": self.eval["accuracy"], "train_loss": None}]
        self.status = "ready"
        self._publish()

    async def _step_locked(self) -> None:
        if self.step >= STEPS or self.status == "error":
            return
        try:
            replies = await self._call("step", step=self.step + 1)
        except (WorkerError, OSError) as exc:
            await self._close_group()
            self._fail(exc)
            self._publish()
            return
        self.step += 1
        self.eval = replies[0]["eval"]
        self.train_loss = replies[0]["train_loss"]
        old = {r["rank"]: r for r in self.ranks}
        self.ranks = _relative([{**old.get(r, {"rank": r}), "memory": rep["memory"],
                                 "events": rep["events"], "t0": rep["t0"]}
                                for r, rep in enumerate(replies)])
        self.history.append({"step": self.step, "loss": self.eval["loss"],
                             "accuracy": self.eval["accuracy"], "train_loss": self.train_loss})
        if self.step >= STEPS:
            self.training = False
            self.status = "done"
        else:
            self.status = "training" if self.training else "ready"
        self._publish()

    # --- the controls -------------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            await self._setup()

    async def reset(self) -> None:
        """New data and a new initialisation, same config."""
        await self.pause()
        async with self._lock:
            self.seed = self._rng.randrange(2**31)
            await self._setup()

    async def configure(self, changes: dict) -> None:
        """Apply control changes (ValueError on a bad one) and start a new run."""
        new = RunConfig.from_json(changes, self.config)
        await self.pause()
        async with self._lock:
            self.config = new
            self.seed = self._rng.randrange(2**31)
            await self._setup()

    async def train_step(self) -> None:
        await self.pause()
        async with self._lock:
            await self._step_locked()

    async def train(self) -> None:
        """Run the remaining steps, one every `step_interval_s`, until done or paused."""
        if self.training or self.step >= STEPS or self.status == "error":
            return
        self.training = True
        self.status = "training"
        self._publish()
        self._train_task = asyncio.create_task(self._train_loop())

    async def _train_loop(self) -> None:
        while self.training and self.step < STEPS:
            async with self._lock:
                if not self.training:
                    break
                await self._step_locked()
            if self.training and self.step < STEPS:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.step_interval_s)
                except asyncio.TimeoutError:
                    pass

    async def pause(self) -> None:
        """Stop training after the step in flight; return once no step is running."""
        was = self.training
        self.training = False
        task, self._train_task = self._train_task, None
        if task is not None:
            # Never cancel the task: a step cancelled half-way would leave the page's
            # counter behind the ranks'. Wake it from its wait and let it finish its step.
            self._wake.set()
            await task
            self._wake.clear()
        if was and self.step < STEPS and self.status != "error":
            self.status = "paused"
            self._publish()

    async def close(self) -> None:
        await self.pause()
        async with self._lock:
            await self._close_group()
