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

[Note: one stop by two routes] Under torchrun inside an srun step, Slurm signals every process
of the step's cgroup (scancel, the time limit), torchrun's workers included, and torchrun's
agent forwards the SIGTERM it got to each worker as SIGTERM: every worker gets the one stop
twice, milliseconds apart, and took the second as "stop now" (the stop's checkpoint lost). A
handler cannot tell who sent a signal, so under a torchelastic agent the same signal again
within DUPLICATE_S of the first is taken as that first one arriving by its other route. A
stop meant twice comes later than that, or as SIGINT or SIGKILL. (shardwise's own `--nproc`
launcher passes a stop on as a relay instead: [Note: relayed stops] in shardwise/launch.py.)

The handlers are the command's (commands/train.py installs them around the run): a library
user's script keeps its own signal handling.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

# Signals `checkpoint.stop_signal` may name: the ones sbatch --signal is used with, whose
# default action would end the process without a checkpoint.
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM")

# [Note: one stop by two routes]: torchrun's agent forwards the signal within its monitor
# interval (0.1 s); a loaded machine can take a second more.
DUPLICATE_S = 3.0


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
    set `signum` and `when` instead of ending the process; a second one raises SignalStop
    (under a torchelastic agent, not the same signal within DUPLICATE_S: [Note: one stop by
    two routes])."""

    def __init__(self, extra: str = "") -> None:
        self.signals = [signal.SIGTERM] + ([signal.Signals[signal_name(extra)]]
                                           if extra else [])
        self.signum = 0
        self.when = 0.0  # time.time() of the first signal: ranks compare them
        self._first = 0.0  # time.monotonic() of the first signal
        self._before: list[tuple[int, Any]] = []
        # [Note: one stop by two routes]: a parent that forwards the signals it gets.
        self._forwarded = bool(os.environ.get("TORCHELASTIC_RUN_ID"))

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum:
            if (self._forwarded and signum == self.signum
                    and time.monotonic() - self._first < DUPLICATE_S):
                return  # the same stop by its other route
            raise SignalStop(signum)
        self.signum, self.when, self._first = signum, time.time(), time.monotonic()

    def _relayed(self, relay: int, frame: Any) -> None:
        # The launcher passed a stop on ([Note: relayed stops] in shardwise/launch.py): the
        # same request as the signal itself, which the worker may have had directly too, so
        # never a second one.
        from ..launch import note_relayed

        signum = relay - int(signal.SIGRTMIN)
        note_relayed(signum)
        if not self.signum:
            self.signum, self.when, self._first = signum, time.time(), time.monotonic()

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


# torchrun's default `--signals-to-handle`: what its agent catches and passes on.
TORCHRUN_HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def unhandled_by_torchrun(extra: str) -> str:
    """Under torchrun, why a `checkpoint.stop_signal` its agent does not handle would lose the
    stop ("" when it does, or when this is not torchrun's worker).

    Slurm's `--signal` reaches every process of the step, torchrun's agent too, and a signal
    the agent does not handle takes its default action there: the agent ends, and Slurm ends
    the step's other processes with it, the workers that were writing the stop's checkpoint.
    """
    from ..launch import WORKER_ENV

    name = signal_name(extra)
    if not name or not os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(WORKER_ENV):
        return ""  # (shardwise's own launcher handles its stop signals itself)
    handled = [signal_name(n) for n in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE",
                                                       TORCHRUN_HANDLED).split(",") if n.strip()]
    if name in handled:
        return ""
    return (f"checkpoint.stop_signal={name}: torchrun's agent does not handle {name}, so the "
            f"{name} that Slurm's --signal sends to every process of the step ends the agent, "
            "and the step with it, before the stop's checkpoint is written; start torchrun "
            f"with --signals-to-handle {','.join([*handled, name])}")


def first_request(rows: list[tuple[float, float]]) -> tuple[int, int] | None:
    """(rank, signal number) of the earliest request among every rank's (signum, when), or
    None when no rank has one."""
    asked = [(when, r, int(signum)) for r, (signum, when) in enumerate(rows) if signum]
    if not asked:
        return None
    _, rank, signum = min(asked)
    return rank, signum
