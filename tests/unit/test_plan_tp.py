"""Issue 15: the planner's FSDP x TP numbers, each against its formula written term by term.

The reference for a TP plan is the plain FSDP plan it must reduce to: tp 1 is exactly the
FSDP plan; tp t on W ranks holds, per rank, the block matrices / t sharded over W / t ranks
and the rest (embedding, norms) sharded over W / t; the TP group's traffic is Megatron's
all-reduces of b x s x d activations (Korthikanti et al. 2022).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import shardwise as sw

SHAPE = {"n_layers": 4, "d_model": 512, "n_heads": 8, "vocab_size": 1000}
D, L, V, F = 512, 4, 1000, 2048
BLOCK_MATRICES = 4 * D * D + 2 * D * F
PARAMS = L * (BLOCK_MATRICES + 2 * D) + V * D + D


def plan(**kw: object) -> sw.Plan:
    args = dict(world_size=8, shape=SHAPE, mixed_precision="bf16", ranks_per_node=8,
                device="h100-80gb", batch_size=2, seq_len=256)
    args.update(kw)
    return sw.plan(PARAMS, **args)  # type: ignore[arg-type]


def test_tp1_is_the_fsdp_plan() -> None:
    a, b = plan(), plan(tensor_parallel=1)
    assert a.per_rank == b.per_rank and a.comm == b.comm and a.time == b.time
    assert b.tp_comm is None


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_model_states_split_block_matrices_by_tp(tp: int) -> None:
    p = plan(tensor_parallel=tp)
    dp = 8 // tp
    assert p.shard_size == dp and p.world_size == 8 and p.tensor_parallel == tp
    # fp32 master shard: block matrices / tp, everything / dp (all sizes divide: no padding).
    per_rank = (L * BLOCK_MATRICES // tp + L * 2 * D + V * D + D) // dp
    assert p.per_rank.params_bytes == 4 * per_rank
    # Gradients: the same rows, plus a few bytes of per-parameter flags in the reduction.
    assert 0 <= p.per_rank.grads_bytes - 4 * per_rank < 1024
    assert p.params == PARAMS  # the model's total, not one TP rank's


@pytest.mark.parametrize("checkpointing,per_layer", [(False, 4), (True, 6)])
def test_tp_all_reduces_per_layer(checkpointing: bool, per_layer: int) -> None:
    tp, b, s = 4, 2, 256
    p = plan(tensor_parallel=tp, activation_checkpointing=checkpointing)
    c = p.tp_comm
    assert c is not None and c.all_reduces_per_layer == per_layer and not c.inter_node
    one = b * s * D * 2  # bf16 activations
    assert c.bytes_per_all_reduce == one
    assert c.sent_bytes == per_layer * L * (2 * (tp - 1) * one // tp)  # ring all-reduce
    assert p.comm.all_reduce_bytes == c.sent_bytes  # FULL_SHARD itself all-reduces nothing
    assert p.time is not None and c.seconds is not None and c.seconds > 0


def test_tp_across_nodes_is_inter_node() -> None:
    c = plan(world_size=16, tensor_parallel=16, ranks_per_node=8,
             shape={**SHAPE, "n_heads": 16}).tp_comm
    assert c is not None and c.inter_node


def test_tp_compute_and_activations_shrink() -> None:
    one, two = plan(world_size=2), plan(world_size=2, tensor_parallel=2)
    assert one.time is not None and two.time is not None
    # Per rank: blocks' FLOPs halve, the (untied-from-TP) head's do not.
    block = L * (6 * BLOCK_MATRICES + 6 * 256 * D) * 2 * 256
    head = 6 * V * D * 2 * 256
    assert one.time.model_flops == pytest.approx(block + head)
    assert two.time.model_flops == pytest.approx(block / 2 + head)
    assert two.per_rank.activations_bytes < one.per_rank.activations_bytes
    sp = plan(world_size=2, tensor_parallel=2, sequence_parallel=True)
    assert sp.per_rank.activations_bytes < two.per_rank.activations_bytes


@pytest.mark.parametrize("kw,needle", [
    ({"tensor_parallel": 3}, "tensor_parallel=3 must divide world_size=8"),
    ({"tensor_parallel": 0}, "tensor_parallel=0 must be a positive int"),
    ({"tensor_parallel": 8, "shape": {**SHAPE, "n_heads": 4}},
     "tensor_parallel=8 must divide the model's n_heads=4"),
])
def test_bad_tp(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        plan(**kw)


def test_cli_tp() -> None:
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "7b",
                          "--world-size", "16", "--tp", "8", "--device", "h100-80gb",
                          "--mixed-precision", "bf16", "--batch-size", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tensor parallel 8 x FSDP 2" in out.stdout and "intra-node" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "7b",
                          "--world-size", "16", "--tp", "3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "tensor_parallel=3 must divide world_size=16" in bad.stderr
