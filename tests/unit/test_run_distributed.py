"""The test harness's own start-up: a port taken between free_port() and rank 0's store
(seen once in a full suite: EADDRINUSE, every rank failed before running anything) is a
second start on another port, not a failed test."""

from __future__ import annotations

import socket

import pytest

from shardwise import testing
from shardwise.engine.comm.process_group import free_port


def _rank_and_world(rank: int, world: int) -> tuple[int, int]:
    return rank, world


def test_a_port_taken_before_the_store_binds_it_is_a_second_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(testing, "free_port", lambda: next(ports, None) or free_port())
        assert testing.run_distributed(_rank_and_world, 2, timeout_s=120,
                                      collective_timeout_s=5) == [(0, 2), (1, 2)]
