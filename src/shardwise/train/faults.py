"""Fault injection for the trainer's tests: one rank dies, crashes or gets a NaN loss on cue.

The e2e tests run `shardwise train` in a subprocess, so they ask through the environment
(SHARDWISE_TEST_*). The CLI's worker builds a `FaultInjector` from it only when one of those
variables is set, and hands it to `trainer.run`; a normal run gets None and its step loop
makes no fault checks at all. The faults act on one rank only (`rank`, default 1): a fault on
every rank alike would not test that the ranks agree.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

import torch

KILL_AT_STEP = "SHARDWISE_TEST_KILL_AT_STEP"
NAN_AT_STEPS = "SHARDWISE_TEST_NAN_AT_STEPS"
CRASH_AT_STEP = "SHARDWISE_TEST_CRASH_AT_STEP"


def _steps(raw: str) -> frozenset[int]:
    return frozenset(int(s) for s in raw.split(",") if s.strip())


@dataclass(frozen=True)
class FaultInjector:
    """kill_at: SIGKILL at these steps, in the first attempt of a torchelastic job only (so the
    restarted job runs to the end). crash_at: raise RuntimeError (a crash, not a mistake).
    nan_at: the loss times NaN."""

    kill_at: frozenset[int] = frozenset()
    crash_at: frozenset[int] = frozenset()
    nan_at: frozenset[int] = frozenset()
    rank: int = 1
    first_attempt: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FaultInjector | None:
        """The faults the SHARDWISE_TEST_* variables ask for; None when none is set."""
        if not any(v in env for v in (KILL_AT_STEP, NAN_AT_STEPS, CRASH_AT_STEP)):
            return None
        return cls(kill_at=_steps(env.get(KILL_AT_STEP, "")),
                   crash_at=_steps(env.get(CRASH_AT_STEP, "")),
                   nan_at=_steps(env.get(NAN_AT_STEPS, "")),
                   first_attempt=env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")

    def before_step(self, step: int, rank: int) -> None:
        if rank != self.rank:
            return
        if step in self.kill_at and self.first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        if step in self.crash_at:
            raise RuntimeError(f"test crash at step {step}")

    def loss(self, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        if rank == self.rank and step in self.nan_at:
            return loss * math.nan
        return loss
