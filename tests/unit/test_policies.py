from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.engine.api.fully_shard import assign_params, wrap_targets
from shardwise.engine.core.policies import find_block_classes
from tests.models import Block, TinyLM


def test_strategy_parse_and_errors() -> None:
    assert sw.ShardingStrategy.parse("full_shard") is sw.ShardingStrategy.FULL_SHARD
    with pytest.raises(ValueError, match="ZERO9.*FULL_SHARD"):
        sw.ShardingStrategy.parse("ZERO9")


def test_mixed_precision_presets() -> None:
    mp = sw.MixedPrecisionPolicy.parse("bf16")
    assert mp.param_dtype is torch.bfloat16 and mp.reduce_dtype is torch.float32
    with pytest.raises(ValueError, match="fp8"):
        sw.MixedPrecisionPolicy.parse("fp8")


def test_transformer_policy_finds_repeated_blocks() -> None:
    assert find_block_classes(TinyLM()) == {Block}


def test_transformer_policy_uses_no_split_modules() -> None:
    class Named(nn.Module):
        _no_split_modules = ["Linear"]

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

    assert find_block_classes(Named()) == {nn.Linear}


def test_size_policy_is_bottom_up_and_skips_containers() -> None:
    # At 13: a block's up (133) and down (120) are wrapped first; what they leave of the block,
    # its norm (12) and gate (1), is 13, enough for the block itself. Its 14 is not.
    names = [n for n, _ in wrap_targets(TinyLM(), sw.size_policy(13))]
    assert "blocks" not in names  # a ModuleList never runs forward (its 39 would qualify)
    assert "blocks.0" in names
    assert names.index("blocks.0.up") < names.index("blocks.0.down") < names.index("blocks.0")
    assert "blocks.0" not in [n for n, _ in wrap_targets(TinyLM(), sw.size_policy(14))]


def test_tied_parameter_goes_to_common_ancestor() -> None:
    model = TinyLM()
    targets = wrap_targets(model, lambda m: isinstance(m, (nn.Embedding, nn.Linear)))
    units = {u.name: [p.fqn for p in u.params] for u in assign_params(model, targets)}
    assert "embed.weight" in units[""]  # tied with head.weight: owned by the root
    assert units["embed"] == []


def test_bad_wrap_policy_names_value() -> None:
    with pytest.raises(ValueError, match="'blocks'"):
        sw.shard_model(TinyLM(), auto_wrap_policy="blocks")
    with pytest.raises(ValueError, match="no block classes"):
        sw.shard_model(nn.Linear(2, 2), auto_wrap_policy="transformer")
