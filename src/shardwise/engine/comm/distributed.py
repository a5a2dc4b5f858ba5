"""Process-group start-up from torchrun's environment, and gradient-sync control."""

from __future__ import annotations

import math
import os
import socket

import torch

from . import collectives as C
from .process_group import DEFAULT_TIMEOUT_S
from .slurm import use_slurm_env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it); another process may
    still take it before the caller binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    backend: str | None = None, timeout_s: float | None = None
) -> tuple[int, int, torch.device]:
    """Join the process group described by torchrun's environment; return (rank, world, device).

    Without torchrun's variables it starts a one-process group on 127.0.0.1, so the same
    script runs alone. Backend: NCCL when CUDA is available, else gloo. `timeout_s` (default
    SHARDWISE_TIMEOUT or 300) bounds every collective, so a dead rank raises instead of
    hanging forever.
    """
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo', 'nccl' or None")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which is not available here; use 'gloo'")
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} is not allowed: must be a finite number > 0")
    else:
        env = os.environ.get("SHARDWISE_TIMEOUT")
        try:
            timeout_s = float(env) if env is not None else DEFAULT_TIMEOUT_S
        except ValueError:
            timeout_s = math.nan
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"SHARDWISE_TIMEOUT={env!r} is not allowed: must be a finite "
                             "number of seconds > 0")
    if "RANK" not in os.environ and not C.is_initialized():
        use_slurm_env()  # an srun task without torchrun: Slurm's variables say who we are
    if "RANK" not in os.environ and not C.is_initialized():
        # Alone (no launcher); a group that exists already (Ray Train's) is joined as it is.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = float(timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not C.is_initialized():
        C.init_process_group(backend, timeout)
    return C.rank(), C.world_size(), device
