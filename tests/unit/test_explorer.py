"""The explorer's parts without a browser or processes: data, config, caution, replay, session."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shardwise.explorer import caution as C
from shardwise.explorer.problem import (
    GRID,
    N_POINTS,
    evaluate,
    make_model,
    make_problem,
    rank_slice,
)
from shardwise.explorer.replay import load_run, working_set
from shardwise.explorer.session import REFERENCE_BYTES, STEPS, Session
from shardwise.explorer.workers import RunConfig, WorkerError, offload_support
from tests.e2e.replay_fixture import write_run


def test_problem_is_a_function_of_the_seed() -> None:
    a, b, c = make_problem(3), make_problem(3), make_problem(4)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert a.x.shape == (N_POINTS, 16) and a.xy.shape == (N_POINTS, 2)
    assert torch.bincount(a.y).tolist() == [N_POINTS // 4] * 4
    # The 2-D coordinates are the inputs' projection onto the plane (up to the noise).
    assert torch.allclose(a.x @ a.proj, a.xy, atol=0.5)
    m1, m2 = make_model(3), make_model(3)
    assert sum(p.numel() for p in m1.parameters()) == 676
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_cover_the_batch_once(world: int) -> None:
    rows = [i for r in range(world) for i in range(N_POINTS)[rank_slice(r, world)]]
    assert rows == list(range(N_POINTS))


def test_evaluate_gives_regions_for_every_lattice_point() -> None:
    p = make_problem(0)
    out = evaluate(make_model(0), p)
    assert len(out["regions"]) == GRID * GRID and set(out["regions"]) <= set("0123")
    assert len(out["confidence"]) == GRID * GRID
    assert 0.0 <= out["accuracy"] <= 1.0 and out["loss"] > 0


def test_run_config_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="strategy='ZERO9'"):
        RunConfig(strategy="ZERO9")
    with pytest.raises(ValueError, match="world_size=5"):
        RunConfig.from_json({"world_size": 5})
    with pytest.raises(ValueError, match="unknown config keys"):
        RunConfig.from_json({"lr": 1})
    assert RunConfig.from_json({"world_size": "2"}).world_size == 2
    assert RunConfig(strategy="HYBRID_SHARD").local_world_size == 2
    if not torch.cuda.is_available():
        assert offload_support(4)[0] is False
        with pytest.raises(ValueError, match="cpu_offload=True"):
            RunConfig(cpu_offload=True)


def test_caution_volumes_follow_the_ring_formulas() -> None:
    """The panel's bytes (the planner's) against ring volumes written out by hand: a ring
    all-gather or reduce-scatter over S ranks sends (S-1)/S of the buffer from each rank, an
    all-reduce twice that; parameters travel in the compute dtype, gradients in fp32."""
    P = C.REF_PARAMS
    # The root unit (tied embedding 32000 x 4096, final norm 4096) stays gathered from
    # forward to backward, so FULL_SHARD gathers it once and every block twice.
    root = 32000 * 4096 + 4096
    full = C.caution(RunConfig(world_size=4).to_json())["bytes_per_rank"]
    assert full["all_gather"] == pytest.approx(0.75 * (2 * P - root) * 4, rel=1e-6)
    assert full["reduce_scatter"] == pytest.approx(0.75 * P * 4, rel=1e-6)
    grad_op = C.caution(RunConfig(world_size=4, strategy="SHARD_GRAD_OP",
                                  mixed_precision="bf16").to_json())["bytes_per_rank"]
    assert grad_op["all_gather"] == pytest.approx(0.75 * P * 2, rel=1e-6)
    assert grad_op["reduce_scatter"] == pytest.approx(0.75 * P * 4, rel=1e-6)
    no_shard = C.caution(RunConfig(world_size=4, strategy="NO_SHARD").to_json())
    assert no_shard["bytes_per_rank"]["all_reduce"] == pytest.approx(1.5 * P * 4, rel=1e-6)
    for cfg in (RunConfig(), RunConfig(strategy="HYBRID_SHARD", mixed_precision="bf16"),
                RunConfig(world_size=1, wrap="model")):
        out = C.caution(cfg.to_json())
        assert out["source"] == "planner" and len(out["links"]) == 4
        assert out["total_bytes_per_rank"] >= 0 and out["compute_s"] > 0
    links = C.caution(RunConfig(world_size=4).to_json())["links"]
    assert links[-1]["seconds"] > links[0]["seconds"]  # Ethernet is slower than NVLink


def test_replay_reads_a_run_folder(tmp_path) -> None:
    replay = load_run(write_run(tmp_path / "run"))
    assert replay.ranks == [0, 1] and replay.steps == [1, 2, 3]
    summary = replay.summary()
    step1 = summary["per_step"][0]["ranks"][0]
    # Sent per rank: half of each buffer at 2 ranks ([Note: communication bytes]).
    assert step1["bytes"] == (2 * (2176 + 528) + (2176 + 528)) // 2
    assert step1["working_peak"] == 2176  # one unit gathered at a time
    assert [m["step"] for m in summary["metrics"]] == [1, 2, 3]
    win = replay.window(2, 5)
    assert win["steps"] == [2, 3] and win["ranks"][0]["events"][0]["t0"] == 0.0
    assert working_set(replay.events[0])[0][1] == 2176
    with pytest.raises(ValueError, match="no events-rank"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="no such run folder"):
        load_run(tmp_path / "missing")


class FakeGroup:
    """Stands in for WorkerGroup: replies shaped like the ranks', no processes."""

    made: list[FakeGroup] = []

    def __init__(self, world: int) -> None:
        self.world, self.devices, self.closed = world, ["cpu"] * world, False
        self.fail = False
        FakeGroup.made.append(self)

    def call(self, op: str, **args: object) -> list[dict]:
        if self.fail:
            raise WorkerError("--- rank 1 ---\nboom")
        k = int(args.get("step", 0))  # type: ignore[call-overload]
        ev = {"loss": 1.4 / (1 + k), "accuracy": 0.25 + 0.05 * k, "regions": "", "confidence": []}
        replies = []
        for r in range(self.world):
            rep = {"memory": {"params": 1, "grads": 1, "optimizer": 2, "working_peak": 3},
                   "eval": ev if r == 0 else None}
            if op == "setup":
                rep.update(units=[], mesh={"shard_rank": r, "shard_size": self.world,
                                           "replicate_size": 1}, events=[])
                if r == 0:
                    rep["points"] = [[0.0, 0.0, 1]]
            else:
                rep.update(t0=float(k), train_loss=1.0, events=[
                    {"unit": "0", "phase": "all_gather", "collective": "all_gather",
                     "bytes": 8, "start": k + 0.1 * r, "end": k + 0.2, "live": 8}])
            replies.append(rep)
        return replies

    def close(self) -> None:
        self.closed = True


def test_session_steps_trains_pauses_resets_and_reconfigures() -> None:
    async def scenario() -> None:
        FakeGroup.made.clear()
        s = Session(seed=1, step_interval_s=0.0, group_factory=FakeGroup)  # type: ignore
        await s.start()
        assert (s.step, s.status, len(s.ranks)) == (0, "ready", 4)
        await s.train_step()
        assert s.step == 1 and s.ranks[1]["events"][0]["t0"] == 100.0  # ms after rank 0's
        await s.train()
        while s.training:
            await asyncio.sleep(0.01)
        assert (s.step, s.status) == (STEPS, "done")
        assert [h["step"] for h in s.history] == list(range(STEPS + 1))
        await s.train_step()  # nothing past the last step
        assert s.step == STEPS
        seed = s.seed
        await s.reset()
        assert (s.step, len(s.history)) == (0, 1) and s.seed != seed
        s.step_interval_s = 0.05
        await s.train()
        await asyncio.sleep(0.08)
        await s.pause()
        held = s.step
        await asyncio.sleep(0.15)
        assert s.step == held < STEPS and s.status == "paused"
        await s.configure({"world_size": 2})
        assert len(FakeGroup.made) == 2 and FakeGroup.made[0].closed and len(s.ranks) == 2
        await s.configure({"strategy": "NO_SHARD"})
        assert len(FakeGroup.made) == 2  # same world size: the ranks are reused
        with pytest.raises(ValueError):
            await s.configure({"world_size": 0})
        FakeGroup.made[-1].fail = True
        await s.train_step()
        assert s.status == "error" and "boom" in (s.error or "")
        await s.reset()  # a fresh group after a failure
        assert s.status == "ready" and len(FakeGroup.made) == 3
        state = s.state()
        assert state["reference"] == REFERENCE_BYTES and state["steps"] == STEPS
        await s.close()
        assert FakeGroup.made[-1].closed

    asyncio.run(scenario())
