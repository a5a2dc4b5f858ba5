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


@pytest.mark.parametrize("tables", ["split", "replicate"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_model_states_split_block_matrices_by_tp(tp: int, tables: str) -> None:
    p = plan(tensor_parallel=tp, tp_embeddings=tables)
    dp = 8 // tp
    assert p.shard_size == dp and p.world_size == 8 and p.tensor_parallel == tp
    assert p.tp_embeddings == tables
    # fp32 master shard: block matrices / tp, the (tied) embedding / tp when split,
    # everything / dp (all sizes divide: no padding).
    embedding = V * D // tp if tables == "split" else V * D
    per_rank = (L * BLOCK_MATRICES // tp + L * 2 * D + embedding + D) // dp
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
    one, two = plan(world_size=2), plan(world_size=2, tensor_parallel=2,
                                        tp_embeddings="replicate")
    split = plan(world_size=2, tensor_parallel=2)
    assert one.time is not None and two.time is not None and split.time is not None
    # Per rank: blocks' FLOPs halve; the head's only when it is split (loss parallel).
    block = L * (6 * BLOCK_MATRICES + 6 * 256 * D) * 2 * 256
    head = 6 * V * D * 2 * 256
    assert one.time.model_flops == pytest.approx(block + head)
    assert two.time.model_flops == pytest.approx(block / 2 + head)
    assert split.time.model_flops == pytest.approx(block / 2 + head / 2)
    assert split.per_rank.activations_bytes < two.per_rank.activations_bytes  # logits / tp
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
    assert ("tensor parallel 8 x FSDP 2: embedding and output head split 8 ways by "
            "vocabulary rows (tp_embeddings=split" in out.stdout), out.stdout
    whole = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "7b",
                            "--world-size", "16", "--tp", "8", "--tp-embeddings", "replicate"],
                           capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr
    assert ("tensor parallel 8 x FSDP 2: embedding and output head whole on every TP rank "
            "(tp_embeddings=replicate" in whole.stdout), whole.stdout
    bad = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "7b",
                          "--world-size", "16", "--tp", "3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "tensor_parallel=3 must divide world_size=16" in bad.stderr


def _parallelized_bytes(tables: str, world: int, tp: int) -> tuple[int, int]:
    """Llama 3 70B built on the meta device and parallelized for real (PyTorch's
    parallelize_module on a (dp, tp) mesh of a fake process group: one process, no memory):
    Megatron's plan on each block, and for "split" torchtitan's plan of the embedding
    (RowwiseParallel: vocab rows) and head (ColwiseParallel: vocab rows). Returns (fp32
    bytes rank 0 holds once FSDP chunks each TP-local tensor's dim 0 over dp, and the
    parameters of one TP rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.unit.test_plan_config import REAL, meta_model

    model = meta_model(REAL["llama3-70b"])
    block = {f"{m}.{n}": ColwiseParallel() for m, names in (
        ("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
        for n in names}
    block.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], block)
        if tables == "split":
            parallelize_module(model, mesh["tp"], {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        dp = world // tp
        held = per_tp_rank = 0
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            rows = local.shape[0]
            held += -(-rows // dp) * (local.numel() // rows) * 4  # rank 0's dim-0 chunk
            per_tp_rank += local.numel()
    finally:
        dist.destroy_process_group()
    return held, per_tp_rank


@pytest.mark.parametrize("tables", ["split", "replicate"])
def test_tp_embeddings_equal_a_parallelized_meta_model(tables: str) -> None:
    """Issue 37: the embedding and head were whole on every TP rank, implicitly (21.3 GB
    of model states per rank for Llama 3 70B at tp 8 on 64 ranks in bf16, against 17.6 GB
    with torchtitan's plan). Both choices, against the bytes a real parallelize_module of
    the meta-built model holds per rank: the fp32 master shard exactly, and AdamW's two
    moments twice that (plus one step counter per tensor)."""
    held, per_tp_rank = _parallelized_bytes(tables, 64, 8)
    p = sw.plan("llama3-70b", world_size=64, tensor_parallel=8, mixed_precision="bf16",
                tp_embeddings=tables)
    assert p.tp_embeddings == tables
    assert p.per_rank.params_bytes == held, (tables, p.per_rank.params_bytes, held)
    tensors = 9 * 80 + 3  # 9 per layer, embedding, norm, head
    assert 0 <= p.per_rank.optimizer_bytes - 2 * held <= 4 * tensors
    # One TP rank's parameters: everything / 8 but the 161 norms (and the tables when whole).
    total, norms, tables_n = 70_553_706_496, 161 * 8192, 2 * 128256 * 8192
    whole = norms + (tables_n if tables == "replicate" else 0)
    assert per_tp_rank == (total - whole) // 8 + whole
    # 17.6 GB (split) against 21.3 GB (whole) of model states per rank.
    gb = round(p.per_rank.model_states_bytes / 1e9, 1)
    assert gb == (17.6 if tables == "split" else 21.3), gb
