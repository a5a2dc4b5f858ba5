"""One schedule, three executors: the engine's hooks and the planner's memory and time
replays.

All drive engine/core/schedule.py's `Schedule`; changing its in-flight limits must change what
they do in the same way, and the time model must take the engine's decisions in its order.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.engine.core.policies import DEFAULT_COALESCE_BYTES
from shardwise.engine.core.schedule import Limits
from shardwise.planner import timing as T
from shardwise.planner.memory import unit_cost
from shardwise.planner.profiles import InterconnectProfile
from shardwise.planner.simulate import StepActivations, simulate
from shardwise.planner.simulate import terms as simulate_terms
from shardwise.planner.timed_replay import Replay
from shardwise.planner.units import units_of_model
from shardwise.testing import run_distributed
from shardwise.train.model import GPT, GPTConfig
from tests.dist import schedule_workers
from tests.models import make_model

WORLD = 2


def _planned(limits: Limits, coalesce_bytes: int = DEFAULT_COALESCE_BYTES):
    with torch.device("meta"):
        model = make_model("lm", 0)
    mu = units_of_model(model, "transformer", None)
    costs = [unit_cost(u, WORLD, 0, None, False) for u in mu.units]
    return simulate(costs, shard_size=WORLD, reshard_after_forward=True,
                    acts=StepActivations(), static_bytes=0, optimizer_bytes=0,
                    optimizer_temp_bytes=0, scratch=True, limits=limits,
                    coalesce_bytes=coalesce_bytes), len(costs)


@pytest.mark.parametrize("gathers,reduces,coalesce", [(2, 2, 0), (1, 1, 0), (0, 1, 0),
                                                      (2, 2, DEFAULT_COALESCE_BYTES)])
def test_limits_change_engine_and_planner_alike(gathers: int, reduces: int,
                                                coalesce: int) -> None:
    engine = run_distributed(schedule_workers.in_flight, WORLD, gathers, reduces, coalesce)
    planned, n_units = _planned(Limits(gathers, reduces), coalesce)
    for rank_result in engine:
        assert rank_result["units"] == n_units
        assert rank_result["gathers"] == planned.gathers_in_flight
        assert rank_result["reduces"] == planned.reduces_in_flight
        # Prefetching happens exactly when the limit allows any all-gather ahead of need.
        assert (rank_result["prefetches"] > 0) == (gathers > 0)
    # Every unit of the tiny LM (3 blocks and the root) reduces: the limit binds; coalesced
    # ([Note: coalesced units]), the four reduce in one reduce-scatter.
    assert planned.reduces_in_flight == (min(reduces, n_units) if not coalesce else 1)


def test_tighter_limits_lower_the_planned_peak() -> None:
    # Units alone: coalesced, the tiny model's units are one group whatever the limits.
    loose, _ = _planned(Limits(2, 2), 0)
    tight, _ = _planned(Limits(0, 1), 0)
    assert tight.comm_buffers < loose.comm_buffers
    assert tight.backward <= loose.backward


GPT_CFG = dict(vocab_size=64, block_size=8, n_layer=3, n_head=2, d_model=16)


def _time_model(reshard: bool, limits: Limits) -> Replay:
    """The planner's time replay of the same GPT, as `plan` builds it (timing.py)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT_CFG))
    mu = units_of_model(model, "transformer", None)
    costs = [unit_cost(u, WORLD, 0, None, False) for u in mu.units]
    colls = T.collectives(costs, shard_size=WORLD, replicate_size=1,
                          reshard_after_forward=reshard, ranks_per_node=WORLD)
    link = InterconnectProfile("test", 1e9, 1e-5)
    n = len(costs)
    work = T.UnitWork(tuple(1e-3 * (i + 1) for i in range(n)), (2e-3,) * n)
    # The engine coalesces these tiny units ([Note: coalesced units]): so does the model.
    terms = [simulate_terms(c, WORLD, DEFAULT_COALESCE_BYTES) for c in costs]
    replay = T.step_replay(work, colls, T.Links(link, link, WORLD), False, limits,
                           terms=terms)
    replay.step_seconds()
    return replay


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("gathers,reduces", [(0, 1), (1, 1), (2, 2)])
def test_engine_and_time_model_take_the_same_decisions(strategy: str, gathers: int,
                                                       reduces: int) -> None:
    # [Note: decision log]: the engine's hooks and the time model's replay each drive a
    # Schedule; for the same limits they must gather, wait, reshard, reduce and finish
    # the same units in the same order, every rank alike.
    limits = Limits(gathers, reduces)
    engine = run_distributed(schedule_workers.decision_log, WORLD, strategy, gathers,
                             reduces, GPT_CFG)
    replay = _time_model(strategy == "FULL_SHARD", limits)
    assert replay.schedule.most_gathers <= gathers
    for log in engine:
        assert [tuple(e) for e in log] == replay.log
    # The time model's communication stream runs the collectives in the engine's issue order.
    issued = [("all_gather" if what == "gather" else "reduce_scatter", i)
              for what, i in replay.log if what in ("gather", "reduce")]
    assert [(kind, i) for kind, i, _, _ in replay.timeline] == issued
    # Each wait in the model's log comes no earlier than that unit's gather completes.
    assert all(start < end for _, _, start, end in replay.timeline)
