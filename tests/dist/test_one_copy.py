"""The one-copy exchange at two ranks ([Note: one-copy exchange] in engine/comm/cma.py):
the same numbers as the gloo path, a fallback both ranks agree on, errors instead of hangs."""

from __future__ import annotations

import time

import pytest

from shardwise.engine.comm import cma
from shardwise.testing import DistributedError, run_distributed
from tests.dist import one_copy_workers as W

TOL = 1e-5

pytestmark = pytest.mark.skipif(not cma.enabled(), reason="no process_vm_readv here")


def _off(diffs: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in diffs.items() if not v < TOL}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_one_copy_matches_gloo_bit_for_bit(strategy: str) -> None:
    one = run_distributed(W.train, 2, strategy)
    gloo = run_distributed(W.train, 2, strategy, env={"SHARDWISE_CMA": "0"})
    for r in range(2):
        assert one[r]["channel"] and one[r]["exchanges"] > 0, one[r]["exchanges"]
        assert not gloo[r]["channel"] and gloo[r]["exchanges"] == 0
        assert not _off(one[r]["diffs"]) and not _off(gloo[r]["diffs"])
        assert one[r]["full"] == gloo[r]["full"]  # the same bits, not just close


@pytest.mark.parametrize("refuse_on", [0, 1])
def test_a_rank_that_cannot_read_its_peer_turns_it_off_on_both(refuse_on: int) -> None:
    res = run_distributed(W.train, 2, "FULL_SHARD", refuse_on)
    for r in res:
        assert not r["channel"] and r["exchanges"] == 0
        assert not _off(r["diffs"])


def test_waits_in_any_order_complete_with_the_peers_values() -> None:
    res = run_distributed(W.any_wait_order, 2)
    for rank, (a, b) in enumerate(res):
        assert a == [10.0 + 1 - rank] * 5 and b == [20.0 + 1 - rank] * 7


def test_ranks_out_of_step_are_named_on_both() -> None:
    res = run_distributed(W.out_of_step, 2, collective_timeout_s=30)
    assert "2 parts where 3 were expected" not in res[0]
    assert "3 parts where 2 were expected" in res[0] and "schedules differ" in res[0]
    assert "one-copy doorbell channel to the peer rank lost" in res[1], res[1]


def test_a_dead_peer_fails_the_wait_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(W.dead_peer, 2, timeout_s=90, collective_timeout_s=60)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "ranks [1] gave no result" in text
    assert "CollectiveError" in text and "blocks.3" in text
    assert "one-copy doorbell channel to the peer rank lost" in text
    assert time.monotonic() - started < 45  # not the 60 s collective timeout


def test_a_peer_that_waits_before_this_rank_issues_is_answered() -> None:
    res = run_distributed(W.late_issue, 2)
    assert res[0] == [2.0] * 3 + [6.0] * 2 and res[1] == [1.0] * 3 + [5.0] * 2


@pytest.mark.parametrize("how", ["bind0", "nounix"])
def test_a_failed_set_up_on_either_side_falls_back_on_both_at_once(how: str) -> None:
    res = run_distributed(W.set_up_fails, 2, how, collective_timeout_s=30)
    for rank, r in enumerate(res):
        assert r["out"] == [2.0 - rank] * 4 and not r["channel"]
        assert r["seconds"] < 10, r  # not a stall until the 30 s timeout


def test_a_stalled_peer_fails_at_the_groups_own_timeout() -> None:
    res = run_distributed(W.group_timeout, 2, collective_timeout_s=60)
    assert res[1] == "slept"
    seconds, _, msg = res[0].partition(" ")
    assert 2.5 < float(seconds) < 5.5, res[0]
    assert "CollectiveError" in msg and "blocks.1" in msg and "timed out after 3 s" in msg


def test_dropped_exchanges_are_not_kept_forever() -> None:
    from shardwise.engine.comm import one_copy

    for held in run_distributed(W.dropped_unwaited, 2):
        assert held <= one_copy._KEEP
