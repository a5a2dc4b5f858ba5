"""Strategies with replicas (NO_SHARD, HYBRID_SHARD) must start `shardwise train` with the
same weights on every replica: the GPT is built on the meta device and materialized sharded,
so this is the materialize step's promise as the trainer uses it."""

from __future__ import annotations

from shardwise.testing import run_distributed


def _weights(rank: int, world: int, strategies: list[str]) -> dict[str, dict[str, list[float]]]:
    import shardwise as sw
    from shardwise.train.config import Config, ModelSection, ShardSection
    from shardwise.train.trainer import build_model

    out = {}
    for strategy in strategies:
        cfg = Config(model=ModelSection(preset="tiny"),
                     shard=ShardSection(sharding_strategy=strategy))
        full = sw.full_state_dict(build_model(cfg), rank0_only=False)
        # Two moments per tensor say "the same values" without shipping the tensors back.
        out[strategy] = {k: [v.double().sum().item(), v.double().square().sum().item()]
                         for k, v in full.items()}
    return out


def test_replicas_start_identical() -> None:
    # LOCAL_WORLD_SIZE=1: HYBRID_SHARD over 2 ranks = 2 "nodes" of 1, i.e. 2 replicas.
    strategies = ["NO_SHARD", "HYBRID_SHARD"]
    out = run_distributed(_weights, 2, strategies, env={"LOCAL_WORLD_SIZE": "1"})
    for s in strategies:
        assert out[0][s] == out[1][s], s
