"""The real sharded run behind the page: 1 to 4 long-lived rank processes on loopback.

`WorkerGroup` spawns `world` processes (spawn start method, gloo on 127.0.0.1, or NCCL
when every rank can have its own GPU), each running `rank.rank_main`, and talks to them
through one command queue per rank and one shared reply queue. A command goes to every
rank (they run collectives together) and `call` waits for all replies, raising
`WorkerError` with every failing rank's traceback, or on a timeout, so a stuck collective
becomes an error on the page and never a hung server.

Torch's elastic launcher (`shardwise.launch`) runs a function to completion; the explorer
needs processes that stay up between button presses, hence plain multiprocessing here.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..engine.comm.process_group import free_port
from ..engine.core.policies import STRATEGY_NAMES as STRATEGIES
from ..launch import workers_ignore_sigint

PRECISIONS = ("none", "bf16", "fp16")
WRAPS = ("layer", "model")
MAX_WORLD = 4


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def offload_support(world: int) -> tuple[bool, str]:
    """Whether CPU offload means anything for this world size, and why not if it does not.

    Offload moves shards from GPU memory to host memory. Ranks compute on a GPU only with
    NCCL, which needs one device per rank; otherwise everything already lives on the CPU.
    """
    n = cuda_devices()
    if n == 0:
        return False, ("No GPU here: the ranks compute on the CPU, where the shards already "
                       "live, so offloading them to the CPU would change nothing.")
    if n < world:
        return False, (f"Needs one GPU per rank: {n} GPU(s) for world size {world}; ranks "
                       "without their own GPU compute on the CPU, where offload is a no-op.")
    return True, f"{n} GPU(s): each rank computes on its own GPU; offload keeps shards in host RAM."


@dataclass(frozen=True)
class RunConfig:
    """The four FSDP knobs plus the world size, as chosen on the page.

    strategy: sharding_strategy passed to `sw.shard_model`.
    world_size: number of rank processes (1 to 4).
    mixed_precision: "none", "bf16" or "fp16" (params gathered and computed in that dtype).
    wrap: "layer" (one unit per Linear, plus the root) or "model" (one unit for everything).
    cpu_offload: keep shards in host memory (only where ranks compute on a GPU).
    """

    strategy: str = "FULL_SHARD"
    world_size: int = 4
    mixed_precision: str = "none"
    wrap: str = "layer"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if not isinstance(self.world_size, int) or not 1 <= self.world_size <= MAX_WORLD:
            raise ValueError(f"world_size={self.world_size!r} must be an int in 1..{MAX_WORLD}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} is not one of "
                             f"{PRECISIONS}")
        if self.wrap not in WRAPS:
            raise ValueError(f"wrap={self.wrap!r} is not one of {WRAPS}")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"cpu_offload={self.cpu_offload!r} must be a bool")
        if self.cpu_offload and not offload_support(self.world_size)[0]:
            raise ValueError(f"cpu_offload=True: {offload_support(self.world_size)[1]}")

    @property
    def local_world_size(self) -> int:
        """Ranks per simulated node. HYBRID_SHARD at 4 ranks: 2 nodes x 2; else one node."""
        if self.strategy == "HYBRID_SHARD" and self.world_size == 4:
            return 2
        return self.world_size

    @classmethod
    def from_json(cls, data: dict, base: RunConfig | None = None) -> RunConfig:
        """A config from the page's JSON (unknown keys rejected, missing keys from `base`)."""
        base = base or cls()
        known = set(asdict(base))
        extra = set(data) - known
        if extra:
            raise ValueError(f"unknown config keys {sorted(extra)}; allowed: {sorted(known)}")
        values = dict(data)
        if "world_size" in values:
            try:
                values["world_size"] = int(values["world_size"])
            except (TypeError, ValueError):
                raise ValueError(f"world_size={values['world_size']!r} is not an int") from None
        return replace(base, **values)

    def to_json(self) -> dict:
        return {**asdict(self), "local_world_size": self.local_world_size}


class WorkerError(RuntimeError):
    """A rank failed or timed out; the message holds each failing rank's traceback."""


class WorkerGroup:
    """`world` rank processes that run commands together. Not thread-safe: one caller."""

    def __init__(self, world: int, timeout_s: float = 60.0, collective_timeout_s: float = 30.0):
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world={world} must be in 1..{MAX_WORLD}")
        self.world = world
        self.timeout_s = timeout_s
        # NCCL only when every rank gets its own GPU; gloo on CPU otherwise.
        self.backend = "nccl" if cuda_devices() >= world else "gloo"
        ctx = mp.get_context("spawn")
        self._out: Any = ctx.Queue()
        self._cmds: list[Any] = [ctx.Queue() for _ in range(world)]
        self._ids = itertools.count(1)
        from .rank import rank_main

        port = free_port()
        self._procs = [
            ctx.Process(target=rank_main, name=f"shardwise-explorer-rank{r}", daemon=True,
                        args=(r, world, port, self._cmds[r], self._out, self.backend,
                              collective_timeout_s))
            for r in range(world)
        ]
        # The server alone handles Ctrl-C and closes the group; a rank still importing torch
        # would otherwise print its own KeyboardInterrupt ([Note: worker signals]).
        with workers_ignore_sigint():
            for p in self._procs:
                p.start()
        self.devices = [r["device"] for r in self._collect(-1, timeout_s=120.0)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def call(self, op: str, **args: Any) -> list[dict]:
        """Send `op` to every rank; return the replies by rank."""
        if not self.alive:
            raise WorkerError("a rank process has exited; the group must be restarted")
        mid = next(self._ids)
        for q in self._cmds:
            q.put({"op": op, "id": mid, **args})
        return self._collect(mid, self.timeout_s)

    def _collect(self, mid: int, timeout_s: float) -> list[dict]:
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, rid, status, value = self._out.get(timeout=min(left, 0.5))
            except queue.Empty:
                if not self.alive:
                    break
                continue
            if rid != mid:
                continue  # a late reply to a command that already failed
            got[rank] = (status, value)
            if status == "error":
                # The others may be blocked in a collective with the failed rank: give them
                # a moment to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + 3.0)
        errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
        missing = [r for r in range(self.world) if r not in got]
        if errors or missing:
            msg = "\n".join(errors)
            if missing:
                msg += f"\nranks {missing} gave no reply within {timeout_s:.0f}s"
            raise WorkerError(msg.strip())
        return [got[r][1] for r in range(self.world)]

    def close(self) -> None:
        """Ask every rank to leave; kill any that does not within a few seconds."""
        for q in self._cmds:
            try:
                q.put({"op": "close", "id": 0})
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for q in [*self._cmds, self._out]:
            q.close()
            q.cancel_join_thread()
