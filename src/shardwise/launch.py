"""Start N local workers with PyTorch's own elastic launcher (what `torchrun` runs).

`launch(fn, nproc, *args)` is `torchrun --standalone --nproc-per-node N` in-process: a
c10d rendezvous on 127.0.0.1 at a free port, workers started by torch.distributed's
launcher, each calling `fn(*args)` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set. Under an
existing torchrun (RANK in the environment) callers should run `fn` directly instead.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0) -> list[Any]:
    """Run `fn(*args)` on `nproc` local worker processes; return their values by rank."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a positive integer")
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, _run_then_finish)(fn, *args)
    return [results[r] for r in sorted(results)]


def _run_then_finish(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, then the clean teardown of the process group `fn` set up (if any).

    See [Note: gloo teardown] in shardwise.engine.process_group: a worker process that exits
    straight after its last collective can abort.
    """
    value = fn(*args)
    from .engine import collectives

    collectives.finish()
    return value
