"""One schedule, two executors: the engine's hooks and the planner's memory replay.

Both drive engine/schedule.py's `Schedule`; changing its in-flight limits must change what
both do, in the same way.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.engine.schedule import Limits
from shardwise.planner.memory import unit_cost
from shardwise.planner.simulate import StepActivations, simulate
from shardwise.planner.units import units_of_model
from shardwise.testing import run_distributed
from tests.dist import schedule_workers
from tests.models import make_model

WORLD = 2


def _planned(limits: Limits):
    with torch.device("meta"):
        model = make_model("lm", 0)
    mu = units_of_model(model, "transformer", None)
    costs = [unit_cost(u, WORLD, 0, None, False) for u in mu.units]
    return simulate(costs, shard_size=WORLD, reshard_after_forward=True,
                    acts=StepActivations(), static_bytes=0, optimizer_bytes=0,
                    optimizer_temp_bytes=0, scratch=True, limits=limits), len(costs)


@pytest.mark.parametrize("gathers,reduces", [(2, 2), (1, 1), (0, 1)])
def test_limits_change_engine_and_planner_alike(gathers: int, reduces: int) -> None:
    engine = run_distributed(schedule_workers.in_flight, WORLD, gathers, reduces)
    planned, n_units = _planned(Limits(gathers, reduces))
    for rank_result in engine:
        assert rank_result["units"] == n_units
        assert rank_result["gathers"] == planned.gathers_in_flight
        assert rank_result["reduces"] == planned.reduces_in_flight
        # Prefetching happens exactly when the limit allows any all-gather ahead of need.
        assert (rank_result["prefetches"] > 0) == (gathers > 0)
    # Every unit of the tiny LM (3 blocks and the root) reduces: the limit binds.
    assert planned.reduces_in_flight == min(reduces, n_units)


def test_tighter_limits_lower_the_planned_peak() -> None:
    loose, _ = _planned(Limits(2, 2))
    tight, _ = _planned(Limits(0, 1))
    assert tight.comm_buffers < loose.comm_buffers
    assert tight.backward <= loose.backward
