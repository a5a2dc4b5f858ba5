"""Issue 44: PyTorch's FSDP1 objects in shardwise's knobs, and `sw.patch_fsdp1()`.

Each of these was refused before (the issue quotes the messages); the refusals that remain
name the field. No process group: the knobs are parsed before any collective.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1_home
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as S
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import shardwise as sw
from shardwise.engine.api.fully_shard import wrap_targets
from shardwise.engine.core.policies import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ShardingStrategy,
    resolve_wrap_policy,
)
from shardwise.fsdp1 import FullyShardedDataParallel
from tests.dist.fsdp1_workers import Block, Net, my_policy


def test_sharding_strategy_takes_fsdp1_enum() -> None:
    assert ShardingStrategy.parse(S.FULL_SHARD) is ShardingStrategy.FULL_SHARD
    assert ShardingStrategy.parse(S.SHARD_GRAD_OP) is ShardingStrategy.SHARD_GRAD_OP
    assert ShardingStrategy.parse(S.NO_SHARD) is ShardingStrategy.NO_SHARD
    assert ShardingStrategy.parse(S.HYBRID_SHARD) is ShardingStrategy.HYBRID_SHARD
    assert ShardingStrategy.parse(S._HYBRID_SHARD_ZERO2) is ShardingStrategy.HYBRID_SHARD
    reshard = ShardingStrategy.reshards_after_forward
    assert reshard(S.FULL_SHARD) and reshard(S.HYBRID_SHARD) and reshard("FULL_SHARD")
    assert not reshard(S._HYBRID_SHARD_ZERO2) and not reshard(S.SHARD_GRAD_OP)
    assert not reshard(S.NO_SHARD)
    with pytest.raises(ValueError, match="sharding_strategy='ZERO9' is not one of"):
        ShardingStrategy.parse("ZERO9")


def _targets(policy: object, model: nn.Module, ignored: set[int] | None = None) -> list[str]:
    return [name for name, _ in wrap_targets(model, resolve_wrap_policy(policy, model, ignored))]


def test_fsdp1_wrap_policies_pick_fsdp1s_modules() -> None:
    model = Net()
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    assert _targets(ModuleWrapPolicy({Block}), model) == blocks
    assert _targets(functools.partial(transformer_auto_wrap_policy,
                                      transformer_layer_cls={Block}), model) == blocks
    assert _targets(functools.partial(lambda_auto_wrap_policy,
                                      lambda_fn=lambda m: isinstance(m, Block)), model) == blocks
    # nonwrapped_numel: each block's fc (182 parameters) is wrapped; what is left of the
    # block (its norm, 26) is under 150, so the block is not (counting its whole subtree, as
    # a module-only size policy does, would wrap it too).
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=150)
    assert _targets(size, model) == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    assert _targets(my_policy, model) == ["inp", "blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    # Ignored parameters do not count: with blocks.0.fc's ignored, it is not wrapped.
    ignored = {id(p) for p in model.blocks[0].fc.parameters()}
    assert _targets(size, model, ignored) == ["blocks.1.fc", "blocks.2.fc"]


def test_custom_policy_with_per_module_kwargs_is_refused() -> None:
    from torch.distributed.fsdp.wrap import CustomPolicy

    policy = CustomPolicy(lambda m: {"sharding_strategy": S.NO_SHARD} if isinstance(
        m, Block) else False)
    with pytest.raises(ValueError, match=r"its own arguments \['sharding_strategy'\]"):
        resolve_wrap_policy(policy, Net())


def test_mixed_precision_takes_fsdp1_fields() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    unit = MixedPrecisionPolicy.parse(mp)
    root = MixedPrecisionPolicy.parse(mp, root=True)
    # reduce_dtype None means param_dtype, as in FSDP1; FSDP1 casts the root's inputs only.
    assert unit == MixedPrecisionPolicy(torch.bfloat16, None, None, False)
    assert root == MixedPrecisionPolicy(torch.bfloat16, None, None, True)
    both = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                          cast_forward_inputs=True, cast_root_forward_inputs=False)
    assert MixedPrecisionPolicy.parse(both).cast_forward_inputs is True
    assert MixedPrecisionPolicy.parse(both, root=True).cast_forward_inputs is False
    assert MixedPrecisionPolicy.parse(MixedPrecision()) is None


@pytest.mark.parametrize(("mp", "field"), [
    (MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True),
     "keep_low_precision_grads=True"),
    (MixedPrecision(param_dtype=torch.int8), "param_dtype"),
    (MixedPrecision(buffer_dtype="half"), "buffer_dtype"),
    (MixedPrecision(cast_forward_inputs=1), "cast_forward_inputs=1"),
])
def test_mixed_precision_field_shardwise_cannot_honour_is_refused(mp: MixedPrecision,
                                                                  field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MixedPrecisionPolicy.parse(mp)


def test_batchnorm_under_fsdp1_mixed_precision_is_refused_before_any_group() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match="_module_classes_to_ignore"):
        sw.shard_model(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                       auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def test_cpu_offload_takes_fsdp1s() -> None:
    assert CPUOffloadPolicy.parse(CPUOffload(offload_params=True)) == CPUOffloadPolicy()
    assert CPUOffloadPolicy.parse(CPUOffload()) is None
    with pytest.raises(ValueError, match="CPUOffload.offload_params"):
        CPUOffloadPolicy.parse(CPUOffload(offload_params="yes"))


def test_fsdp1_constructor_refuses_bad_values_before_any_group() -> None:
    with pytest.raises(ValueError, match="use_orig_params='no'"):
        FullyShardedDataParallel(Net(), use_orig_params="no")
    with pytest.raises(ValueError, match="process_group=.*tuple is not supported"):
        FullyShardedDataParallel(Net(), process_group=(None, None))
    with pytest.raises(ValueError, match="ignored_modules and ignored_states"):
        FullyShardedDataParallel(Net(), ignored_modules=[], ignored_states=[])
    with pytest.raises(ValueError, match="sharding_strategy='ZERO9'"):
        FullyShardedDataParallel(Net(), sharding_strategy="ZERO9")


def test_patch_fsdp1_swaps_homes_and_bound_names_then_undoes() -> None:
    original = torch_fsdp.FullyShardedDataParallel
    user = types.ModuleType("an_fsdp1_framework")
    user.FSDP = original  # `from torch.distributed.fsdp import FullyShardedDataParallel as FSDP`
    sys.modules["an_fsdp1_framework"] = user
    try:
        with sw.patched_fsdp1():
            assert torch_fsdp.FullyShardedDataParallel is FullyShardedDataParallel
            assert fsdp1_home.FullyShardedDataParallel is FullyShardedDataParallel
            assert user.FSDP is FullyShardedDataParallel
        assert torch_fsdp.FullyShardedDataParallel is original
        assert fsdp1_home.FullyShardedDataParallel is original
        assert user.FSDP is original
        undo = sw.patch_fsdp1()
        assert user.FSDP is FullyShardedDataParallel
        undo()
        assert user.FSDP is original
    finally:
        del sys.modules["an_fsdp1_framework"]


def test_torch_modules_imported_after_the_patch_keep_fsdp1s_class() -> None:
    """DCP's state-dict helpers bind FSDP1's class at import; first imported under the
    patch they bound shardwise's, and took a nested model's inner wrappers for FSDP1's
    (`.process_group`). A fresh interpreter: patch first, import after."""
    import subprocess

    code = (
        "import shardwise as sw, torch.distributed.fsdp as f\n"
        "theirs = [f.FullyShardedDataParallel]  # a list: the patch swaps module globals\n"
        "sw.patch_fsdp1()\n"
        "import torch.distributed.checkpoint.state_dict as s\n"
        "import torch.distributed.optim.named_optimizer as n\n"
        "assert s.FSDP is theirs[0] and n.FSDP is theirs[0], (s.FSDP, n.FSDP)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("given", ["HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2",
                                   "hybrid-shard-zero2"])
def test_cli_takes_fsdp1s_hybrid_zero2(given: str) -> None:
    """`shardwise train --shard.sharding_strategy HYBRID_SHARD_ZERO2` (or FSDP1's member
    name): the hybrid mesh, units keeping their parameters from forward to backward."""
    from shardwise import launchers
    from shardwise.train import options as O

    values, _ = O.parse_argv(["--shard.sharding_strategy", given])
    name = O.build(values).shard.sharding_strategy
    assert name == "HYBRID_SHARD_ZERO2"
    assert ShardingStrategy.parse(name) is ShardingStrategy.HYBRID_SHARD
    assert not ShardingStrategy.reshards_after_forward(name)
    assert ShardingStrategy.reshards_after_forward("HYBRID_SHARD")
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert launchers.topology(4, name, environ=env)["mesh"] == launchers.topology(
        4, "HYBRID_SHARD", environ=env)["mesh"]
