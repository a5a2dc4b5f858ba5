"""A small multi-process harness: run a function on N gloo ranks over loopback.

`run_distributed(fn, world_size, *args)` spawns N fresh processes, each joining one process
group, calls `fn(rank, world_size, *args)` in each and raises in the caller with every
rank's traceback if any rank failed or the whole thing ran past `timeout_s` (a hang becomes
an error, never a stuck test). `fn` must be importable (a module-level function).
Run grids of options inside one call to pay process start-up once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from .engine.comm.process_group import free_port


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple,
            results: Any, env: dict[str, str], coll_timeout_s: float, backend: str) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=env.get("LOCAL_WORLD_SIZE", str(world)),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        import torch

        torch.set_num_threads(1)  # N ranks share few cores: no oversubscription
        from shardwise.engine.comm import collectives
        from shardwise.engine.comm import process_group as distributed

        distributed.init_distributed(backend, timeout_s=coll_timeout_s)
        value = fn(rank, world, *args)
        collectives.finish()
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))


class DistributedError(RuntimeError):
    pass


def _context() -> Any:
    """Where ranks come from: a fork server that imported torch and shardwise's API once.

    Importing torch costs each fresh process seconds of CPU; forked from a server that did it
    already, a rank starts in milliseconds. The server itself is a clean process (no threads,
    no process group), so forking it is safe where forking the caller would not be.
    """
    method = os.environ.get("SHARDWISE_TEST_START", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        # The modules every rank imports: torch.distributed.fsdp (init_process_group's,
        # process_group.py says why) and the public API behind the lazy package ([Note: lazy
        # package]: `sw.fully_shard` imports the engine and torch._dynamo). Left to the ranks,
        # they cost each rank 3 to 10 s of CPU on a loaded 2-core machine, every run.
        # SHARDWISE_TEST_PRELOAD names more, comma-separated (a test suite's own helpers).
        extra = [m for m in os.environ.get("SHARDWISE_TEST_PRELOAD", "").split(",") if m]
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                                    "shardwise", "shardwise._api", *extra])
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 240.0,
    collective_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return each rank's value."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    try:
        return _run_once(fn, world_size, args, timeout_s, collective_timeout_s, env, backend)
    except DistributedError as e:
        # free_port's port is free when picked; another process's outgoing connection can
        # take it (an ephemeral port) before rank 0's store binds it. Then no rank ran `fn`
        # (the store is the group's first step): once more, on another port.
        if "EADDRINUSE" not in str(e):
            raise
    return _run_once(fn, world_size, args, timeout_s, collective_timeout_s, env, backend)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...],
              timeout_s: float, collective_timeout_s: float, env: dict[str, str] | None,
              backend: str) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, env or {},
                                          collective_timeout_s, backend), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                got[rank] = (status, value)
                if status == "error":
                    # Let the others fail on their collective timeout... or give them a moment.
                    deadline = min(deadline, time.monotonic() + 10.0)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            msg += f"\nranks {missing} gave no result (crashed or timed out after {timeout_s}s)"
        raise DistributedError(msg)
    return [got[r][1] for r in range(world_size)]
