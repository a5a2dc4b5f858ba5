"""Issue 23: the time model replays the engine's own schedule, decision for decision."""

from __future__ import annotations

import pytest
import torch

from shardwise.engine.core.schedule import Limits
from shardwise.planner.memory import UnitCost
from shardwise.planner.profiles import InterconnectProfile
from shardwise.planner.replay import replay_backward, replay_forward
from shardwise.planner.simulate import StepActivations, _Sim, terms
from shardwise.planner.timed_replay import Replay
from shardwise.planner.timing import Collective, Links, UnitWork, overlapped_step

N = 6  # root + 5 blocks


def _cost(i: int) -> UnitCost:
    n = 1000 * (i + 1)
    return UnitCost(f"u{i}", n, 1, i == 0, 4 * n, 4 * n, 4 * n, 2, 4 * n,
                    ((torch.float32, n // 2),), ((torch.float32, n // 2 + 2, 2 * n),),
                    8 * n, 8 * n, False)


def _memory_log(reshard: bool, limits: Limits, coalesce: int) -> list[tuple[str, int]]:
    sim = _Sim([_cost(i) for i in range(N)], 2, reshard, StepActivations(), True, limits,
               coalesce)
    replay_forward(sim.schedule, sim)
    replay_backward(sim.schedule, sim)
    sim.schedule.log = []  # the second step prefetches from the recorded order
    replay_forward(sim.schedule, sim)
    replay_backward(sim.schedule, sim)
    return [(what, u.i) for what, u in sim.schedule.log]


@pytest.mark.parametrize("coalesce", [0, 20_000])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("limits", [Limits(0, 1), Limits(1, 1), Limits(2, 2), Limits(3, 3)])
def test_time_model_takes_the_memory_replays_decisions(reshard: bool, limits: Limits,
                                                       coalesce: int) -> None:
    # The memory replay drives the engine's Schedule (tests/dist/test_schedule.py checks it
    # against the engine); the time model's replay must take the same decisions in order,
    # small units coalesced or not ([Note: coalesced units]: 4 KB to 24 KB units, groups of
    # up to 20 KB).
    r = Replay([1.0] * N, [2.0] * N, lambda kind, unit, phase: 0.5,
               reshard_after_forward=reshard, sync_all_reduce=False, limits=limits,
               terms=[terms(_cost(i), 2, coalesce) for i in range(N)])
    r.step_seconds()
    log = _memory_log(reshard, limits, coalesce)
    assert r.log == log
    # One reduce-scatter per unit, or fewer where units share one (the timeline names every
    # member of a shared one with the same interval).
    shared = {(start, end) for kind, _, start, end in r.timeline if kind == "reduce_scatter"}
    assert (len(shared) < N) == bool(coalesce)
    assert r.schedule.most_gathers <= limits.gathers
    assert r.schedule.most_reduces <= limits.reduces


def test_limits_change_the_predicted_time() -> None:
    # Slow gathers: prefetching more hides more of them; none at all hides nothing.
    colls = [Collective("all_gather", i, ph, 8_000_000, 2, False)
             for i in range(N) for ph in ("forward", "backward")]
    link = InterconnectProfile("test", 1e9, 0.0)
    links = Links(link, link, 8)
    work = UnitWork((0.004,) * N, (0.008,) * N)
    t0 = overlapped_step(work, colls, links, 0.0, False, Limits(0, 2))
    t1 = overlapped_step(work, colls, links, 0.0, False, Limits(1, 2))
    serial = sum(work.forward_s) + sum(work.backward_s) + sum(links.seconds(c) for c in colls)
    assert t1 < t0 <= serial + 1e-12
