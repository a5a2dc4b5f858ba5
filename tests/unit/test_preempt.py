"""StopRequest's rules for a second stop signal, and the torchrun stop-signal warning
([Note: one stop by two routes] in shardwise/train/preempt.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shardwise.launch import WORKER_ENV
from shardwise.train import preempt
from shardwise.train.preempt import SignalStop, StopRequest, unhandled_by_torchrun


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary of the main thread


def test_under_torchrun_the_same_signal_again_soon_is_the_same_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with StopRequest() as stop:
        _signal_self(signal.SIGTERM)
        first = stop.when
        _signal_self(signal.SIGTERM)  # the agent's forward of the same stop
        assert (stop.signum, stop.when) == (signal.SIGTERM, first)


def test_a_second_signal_later_or_without_an_agent_stops_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setattr(preempt, "DUPLICATE_S", 0.05)
    with StopRequest() as stop:
        _signal_self(signal.SIGTERM)
        time.sleep(0.1)
        with pytest.raises(SignalStop):
            _signal_self(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with StopRequest():
        _signal_self(signal.SIGTERM)
        with pytest.raises(SignalStop):
            _signal_self(signal.SIGTERM)  # a Slurm task's second SIGTERM: "now"
    with StopRequest("USR1"):
        _signal_self(signal.SIGUSR1)
        with pytest.raises(SignalStop):
            _signal_self(signal.SIGTERM)  # another signal is never a duplicate


def test_a_stop_signal_torchrun_would_not_pass_on_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    monkeypatch.delenv(WORKER_ENV, raising=False)
    assert unhandled_by_torchrun("USR1") == ""  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert unhandled_by_torchrun("") == ""
    assert unhandled_by_torchrun("SIGHUP") == ""  # torchrun's default handles it
    assert unhandled_by_torchrun("usr1") == (
        "checkpoint.stop_signal=SIGUSR1: torchrun's agent does not handle SIGUSR1, so the "
        "SIGUSR1 that Slurm's --signal sends to every process of the step ends the agent, and "
        "the step with it, before the stop's checkpoint is written; start torchrun with "
        "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1")
    assert unhandled_by_torchrun("SIGUSR1") == ""
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    monkeypatch.setenv(WORKER_ENV, "1")  # shardwise's own launcher passes it on itself
    assert unhandled_by_torchrun("SIGUSR1") == ""
