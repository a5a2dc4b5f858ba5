"""The exit drain of a failing script waits for gloo, not for the uncaught traceback.

CPython keeps the last uncaught exception (sys.last_value) to the end; the frames of the
failed collective (torch's call, shardwise's issue) hold the aliases it was handed as locals,
so the drain's wait for their release ran its whole bound (1 s per rank, on every rank of a
stopping job) while no gloo thread held anything ([Note: stopping together]).
"""

from __future__ import annotations

import sys

import torch

from shardwise.engine.comm import process_group as pg


def _collective(buf: torch.Tensor) -> None:
    handed = pg.handoff(buf)  # a local of the frame, as in torch's collective call
    raise RuntimeError(f"Timed out waiting for {handed.numel()} elements")


def _issue(buf: torch.Tensor) -> None:
    try:
        _collective(buf)
    except RuntimeError as e:
        raise ValueError("the collective failed") from e


def test_the_uncaught_exceptions_frames_release_the_aliases(monkeypatch) -> None:
    pg._handed.clear()
    try:
        _issue(torch.zeros(4))
    except ValueError as e:
        caught = e
    monkeypatch.setattr(sys, "last_value", caught, raising=False)
    if sys.version_info >= (3, 12):
        monkeypatch.setattr(sys, "last_exc", caught, raising=False)
    del caught
    assert pg.held_by_gloo() == 1  # the cause's traceback keeps the alias
    pg._release_failed_frames()
    assert pg.held_by_gloo() == 0
    assert pg.wait_for_gloo_drops(0.0)
