"""Preemption: SIGTERM (and `checkpoint.stop_signal`) ask the run to stop at a step boundary.

Slurm ends a job (scancel, the time limit, a preemption) with SIGTERM to every task and a
SIGKILL 30 s later (KillWait / GraceTime); `sbatch --signal=USR1@120` sends a chosen signal
ahead of the end instead. Either way the run should not lose the steps since its last
checkpoint. `StopRequest` turns the signal into a request: the handler only notes which
signal came and when. The trainer hands the note to every rank inside the step's existing
all-gather (the losses' one: no extra collective), so every rank sees the same requests after
the same step, however many of them got the signal; they all finish that step, write a
checkpoint and return (trainer.run). A second signal while the step finishes stops the rank
at once (`SignalStop`), as Ctrl-C does.

The handlers are the command's (commands/train.py installs them around the run): a library
user's script keeps its own signal handling.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

# Signals `checkpoint.stop_signal` may name: the ones sbatch --signal is used with, whose
# default action would end the process without a checkpoint.
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM")


def signal_name(value: str) -> str:
    """`usr1`, `USR1`, `SIGUSR1` -> `SIGUSR1` ("" stays "")."""
    text = value.strip().upper()
    return "" if not text else text if text.startswith("SIG") else f"SIG{text}"


class SignalStop(BaseException):
    """A second stop signal while the run was finishing its step: stop now. A BaseException,
    like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} (twice)")


class StopRequest:
    """While active (main thread only), SIGTERM and `extra` (a name from STOP_SIGNALS, or "")
    set `signum` and `when` instead of ending the process; a second one raises SignalStop."""

    def __init__(self, extra: str = "") -> None:
        self.signals = [signal.SIGTERM] + ([signal.Signals[signal_name(extra)]]
                                           if extra else [])
        self.signum = 0
        self.when = 0.0  # time.time() of the first signal: ranks compare them
        self._before: list[tuple[int, Any]] = []

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum:
            raise SignalStop(signum)
        self.signum, self.when = signum, time.time()

    def _relayed(self, relay: int, frame: Any) -> None:
        # The launcher passed a stop on ([Note: relayed stops] in shardwise/launch.py): the
        # same request as the signal itself, which the worker may have had directly too, so
        # never a second one.
        from ..launch import note_relayed

        signum = relay - int(signal.SIGRTMIN)
        note_relayed(signum)
        if not self.signum:
            self.signum, self.when = signum, time.time()

    def __enter__(self) -> StopRequest:
        from ..launch import relay_signal

        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._before.append((s, signal.signal(s, self._handler)))
                relay = relay_signal(s)
                self._before.append((relay, signal.signal(relay, self._relayed)))
        return self

    def __exit__(self, *exc: object) -> None:
        for s, before in reversed(self._before):
            signal.signal(s, before)
        self._before.clear()


def first_request(rows: list[tuple[float, float]]) -> tuple[int, int] | None:
    """(rank, signal number) of the earliest request among every rank's (signum, when), or
    None when no rank has one."""
    asked = [(when, r, int(signum)) for r, (signum, when) in enumerate(rows) if signum]
    if not asked:
        return None
    _, rank, signum = min(asked)
    return rank, signum
