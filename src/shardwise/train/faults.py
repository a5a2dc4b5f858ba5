"""Fault injection for the trainer's tests: one rank dies, crashes, refuses, stalls, gets a
signal or a NaN loss on cue.

The e2e tests run `shardwise train` in a subprocess, so they ask through the environment
(SHARDWISE_TEST_*). The CLI's worker builds a `FaultInjector` from it only when one of those
variables is set, and hands it to `trainer.run`; a normal run gets None and its step loop
makes no fault checks at all. The faults act on one rank only (`rank`, default 1, or
SHARDWISE_TEST_FAULT_RANK): a fault on every rank alike would not test that the ranks agree.
When SHARDWISE_TEST_FAULT_STAMP names a file, the moment a fault fires is written there
(time.time()), so a test can time how long the ranks take to stop after it.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

KILL_AT_STEP = "SHARDWISE_TEST_KILL_AT_STEP"
NAN_AT_STEPS = "SHARDWISE_TEST_NAN_AT_STEPS"
CRASH_AT_STEP = "SHARDWISE_TEST_CRASH_AT_STEP"
REFUSE_AT_STEP = "SHARDWISE_TEST_REFUSE_AT_STEP"
# "STEP:SECONDS": sleep that long before the step (a stalled rank: its peers time out).
STALL_AT = "SHARDWISE_TEST_STALL_AT"
# "STEP:SIGNAL": send this process the signal (SIGINT, SIGTERM, ...) before the step.
SIGNAL_AT = "SHARDWISE_TEST_SIGNAL_AT"
FAULT_RANK = "SHARDWISE_TEST_FAULT_RANK"
FAULT_STAMP = "SHARDWISE_TEST_FAULT_STAMP"
_ALL = (KILL_AT_STEP, NAN_AT_STEPS, CRASH_AT_STEP, REFUSE_AT_STEP, STALL_AT, SIGNAL_AT)


def _steps(raw: str) -> frozenset[int]:
    return frozenset(int(s) for s in raw.split(",") if s.strip())


@dataclass(frozen=True)
class FaultInjector:
    """kill_at: SIGKILL at these steps, in the first attempt of a torchelastic job only (so the
    restarted job runs to the end). crash_at: raise RuntimeError (a crash, not a mistake).
    refuse_at: raise ValueError (a refusal). stall: (step, seconds) asleep before that step.
    signal_at: (step, signal number) sent to this process before that step. nan_at: the loss
    times NaN."""

    kill_at: frozenset[int] = frozenset()
    crash_at: frozenset[int] = frozenset()
    nan_at: frozenset[int] = frozenset()
    rank: int = 1
    first_attempt: bool = True
    refuse_at: frozenset[int] = frozenset()
    stall: tuple[int, float] | None = None
    signal_at: tuple[int, int] | None = None
    stamp: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FaultInjector | None:
        """The faults the SHARDWISE_TEST_* variables ask for; None when none is set."""
        if not any(v in env for v in _ALL):
            return None
        stall = signal_at = None
        if env.get(STALL_AT):
            step, seconds = env[STALL_AT].split(":")
            stall = (int(step), float(seconds))
        if env.get(SIGNAL_AT):
            step, name = env[SIGNAL_AT].split(":")
            signal_at = (int(step), int(signal.Signals[name]))
        return cls(kill_at=_steps(env.get(KILL_AT_STEP, "")),
                   crash_at=_steps(env.get(CRASH_AT_STEP, "")),
                   nan_at=_steps(env.get(NAN_AT_STEPS, "")),
                   rank=int(env.get(FAULT_RANK, "1")),
                   first_attempt=env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0",
                   refuse_at=_steps(env.get(REFUSE_AT_STEP, "")), stall=stall,
                   signal_at=signal_at, stamp=env.get(FAULT_STAMP, ""))

    def _fired(self) -> None:
        if self.stamp:
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))

    def before_step(self, step: int, rank: int) -> None:
        if rank != self.rank:
            return
        if step in self.kill_at and self.first_attempt:
            self._fired()
            os.kill(os.getpid(), signal.SIGKILL)
        if step in self.crash_at:
            self._fired()
            raise RuntimeError(f"test crash at step {step}")
        if step in self.refuse_at:
            self._fired()
            raise ValueError(f"test refusal at step {step}")
        if self.signal_at is not None and step == self.signal_at[0] and self.first_attempt:
            self._fired()
            os.kill(os.getpid(), self.signal_at[1])
        if self.stall is not None and step == self.stall[0]:
            self._fired()
            time.sleep(self.stall[1])

    def loss(self, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        if rank == self.rank and step in self.nan_at:
            return loss * math.nan
        return loss
