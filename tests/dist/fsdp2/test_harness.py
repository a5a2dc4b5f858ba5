"""The grid harness itself ([Note: case deadlines] in harness.py): a case that runs past its
own deadline is the one reported, the other cases still run, and each case is charged its
own time."""

from __future__ import annotations

from tests.dist.fsdp2 import harness_probe_workers as P
from tests.dist.fsdp2.harness import Case, run_world


def test_a_case_past_its_deadline_is_named_and_the_others_still_run() -> None:
    # Rank 1 stalls in the middle case; rank 0 finished it and waits for rank 1. The
    # watchdog that fires is rank 1's, at the case's own 4 s deadline (the grid once had one
    # 1500 s budget per world size, charged to whichever case was running when it ran out).
    before = Case("before", P.agree, worlds=(2,))
    stuck = Case("stuck", P.sleeps, {"seconds": 600.0, "on_rank": 1}, worlds=(2,),
                 timeout_s=4.0)
    after = Case("after", P.agree, worlds=(2,))
    results = run_world(2, [before, stuck, after])
    assert results[before.id].ok and results[after.id].ok, results
    got = results[stuck.id]
    assert not got.ok, results
    assert "ran past its deadline of 4 s" in got.detail and "on ranks [1]" in got.detail, got
    assert "sleeps" in got.detail, got  # rank 1's stack: where it was stuck
    assert got.seconds == 4.0, got


def test_each_case_is_charged_its_own_time() -> None:
    # Measured in the ranks: the first case is not charged the start-up or the others' time.
    # (Lower bounds only, and a quick case against a 2 s sleep: no bound a loaded machine
    # can break.)
    quick = Case("quick", P.agree, worlds=(2,))
    slow = Case("slow", P.sleeps, {"seconds": 2.0}, worlds=(2,))
    results = run_world(2, [quick, slow])
    assert results[quick.id].ok and results[slow.id].ok, results
    assert results[slow.id].seconds >= 2.0, results
    assert results[quick.id].seconds < results[slow.id].seconds, results
