"""`shardwise train --threads 0`: a rank's torch threads from the usable cores, the local
ranks and the other processes' load ([Note: threads per rank] in train/threads.py)."""

from __future__ import annotations

import pytest

from shardwise.train import options as O
from shardwise.train import threads as T
from shardwise.train.trainer import threads_per_rank


@pytest.mark.parametrize("cores, ranks, load, want", [
    (2, 1, 0.1, 2),    # an idle 2-core machine: both cores to the one rank
    (2, 1, 22.0, 1),   # a busy one: 2 threads ran 24x slower than 1 (measured)
    (2, 2, 0.0, 1),
    (16, 2, 0.0, 8),
    (16, 2, 6.0, 5),   # 10 free cores shared by 2 ranks
    (16, 4, 15.5, 1),
    (3, 2, 0.0, 1),    # never more than the rank's share of the cores
    (1, 4, 0.0, 1),    # at least 1
])
def test_choose_threads(cores: int, ranks: int, load: float, want: int) -> None:
    assert T.choose_threads(cores, ranks, load) == want


def test_threads_per_rank_reads_affinity_local_ranks_and_load(monkeypatch) -> None:
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7},
                        raising=False)
    monkeypatch.setattr(T.os, "getloadavg", lambda: (2.0, 0.0, 0.0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads_per_rank(O.build({})) == 3
    assert threads_per_rank(O.build({"threads": "5"})) == 5  # --threads wins
    monkeypatch.setattr(T.os, "getloadavg", lambda: (40.0, 0.0, 0.0))
    assert threads_per_rank(O.build({})) == 1
