"""`shardwise.launch`: how a launch ends (values, WorkerFailure, no temporary folders left)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from shardwise.launch import WorkerFailure, launch


def _rank() -> int:
    return int(os.environ["RANK"])


def _value_error_on_rank_1() -> int:
    if _rank() == 1:
        raise ValueError("bad value on purpose")
    return _rank()


def _crash_on_rank_0() -> int:
    if _rank() == 0:
        raise KeyError("unexpected")
    return _rank()


def test_values_and_no_temporary_folders(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # torchelastic's default leaves an empty /tmp/torchelastic_* behind per launch.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launch(_rank, 2) == [0, 1]
    assert list(tmp_path.iterdir()) == []
    assert "SHARDWISE_WORKER" not in os.environ


def test_expected_errors_are_one_line_and_crashes_carry_a_traceback() -> None:
    with pytest.raises(WorkerFailure) as info:
        launch(_value_error_on_rank_1, 2, expected={ValueError: 2})
    e = info.value
    assert (e.rank, e.exit_code, e.message, e.traceback) == (1, 2, "bad value on purpose", "")
    with pytest.raises(WorkerFailure) as info:
        launch(_crash_on_rank_0, 2, expected={ValueError: 2})
    e = info.value
    assert (e.rank, e.exit_code, e.message) == (0, 1, "KeyError: 'unexpected'")
    assert e.traceback.startswith("Traceback") and "_crash_on_rank_0" in e.traceback
