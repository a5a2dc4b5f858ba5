"""A dead or diverging rank gives an error, never a hang; bad input fails on every rank."""

from __future__ import annotations

import pytest

from shardwise.testing import DistributedError, run_distributed
from tests.dist import failures


def test_dead_rank_raises_on_the_survivor() -> None:
    with pytest.raises(DistributedError) as info:
        run_distributed(failures.dead_rank, 2, timeout_s=90, collective_timeout_s=20)
    text = str(info.value)
    # The survivor raised instead of hanging (a hang reads "ranks [0, 1] gave no result"):
    # what it reported proves it, with no time bound that a loaded machine could break.
    assert "--- rank 0 ---" in text
    assert "ranks [1] gave no result" in text


def test_diverging_rank_is_an_error_on_every_rank() -> None:
    run_distributed(failures.diverging_rank, 2, collective_timeout_s=20)


def test_bad_state_dict_raises_everywhere() -> None:
    run_distributed(failures.bad_state_dict, 3, collective_timeout_s=20)


def test_ranks_disagreeing_on_an_extension_subclass_is_an_error() -> None:
    run_distributed(failures.diverging_subclass, 2, collective_timeout_s=20)
