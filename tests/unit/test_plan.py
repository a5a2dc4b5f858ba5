"""The planner in one process: accounting identities, formulas against counted tensors,
the time model's bookkeeping, and errors that name the bad value."""

from __future__ import annotations

import json
import math

import pytest
import torch

import shardwise as sw
from shardwise.planner import TransformerShape
from shardwise.planner.profiles import DEVICES
from shardwise.train.model import GPT, GPTConfig, preset
from tests.models import TinyLM

P = 7.5e9
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def meta_gpt(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


@pytest.mark.parametrize("n", [1, 8, 64])
def test_zero_accounting_for_a_bare_count(n: int) -> None:
    """ZeRO (Rajbhandari et al. 2020): mixed-precision Adam is 16 bytes per parameter,
    divided by the shard group (FULL_SHARD) or not at all (NO_SHARD)."""
    states = {s: sw.plan(P, world_size=n, sharding_strategy=s, mixed_precision="bf16",
                         ranks_per_node=min(n, 8)).per_rank for s in STRATEGIES}
    # Adam's 0-d step counter (4 bytes per parameter tensor) is all ZeRO leaves out.
    counters = states["NO_SHARD"].optimizer_bytes - 8 * P
    assert 0 <= counters < 1e-6 * P
    fs = states["FULL_SHARD"]
    assert fs.model_states_bytes - counters == pytest.approx(16 * P / n, rel=1e-6)  # padding
    assert states["SHARD_GRAD_OP"].model_states_bytes == fs.model_states_bytes
    # NO_SHARD's gradients are views of its packed all-reduce buffer: flags included.
    assert 0 <= states["NO_SHARD"].model_states_bytes - counters - 16 * P < 1e-6 * P
    # Term by term: fp32 master shard, fp32 gradient shard, two fp32 Adam moments.
    # (The gradient shard also holds one 4-byte "has a gradient" flag per parameter tensor.)
    assert fs.params_bytes == pytest.approx(4 * P / n, rel=1e-6)
    assert 0 <= fs.grads_bytes - fs.params_bytes < 1e-6 * P
    assert fs.optimizer_bytes - counters == pytest.approx(8 * P / n, rel=1e-6)
    # HYBRID shards inside a node of 8 (or the whole world when smaller).
    hs = states["HYBRID_SHARD"]
    assert hs.model_states_bytes - counters == pytest.approx(16 * P / min(n, 8), rel=1e-6)


def test_padding_and_worst_rank() -> None:
    """[Note: layout]: every rank allocates C = ceil(D0/S) rows per parameter; the optimizer
    sees only the valid ones, so the last rank's state is smaller and rank 0 is the worst."""
    with torch.device("meta"):
        model = TinyLM(vocab=11, d=6, n_layers=3, seq=5)
    S = 4
    params = [p for p in model.parameters()]  # tied head counted once
    padded = sum(math.ceil((p.shape[0] if p.dim() else 1) / S)
                 * (p[0].numel() if p.dim() else 1) * 4 for p in params)
    plans = [sw.plan(model, world_size=S, rank=r) for r in range(S)]
    assert all(p.per_rank.params_bytes == padded for p in plans)
    opt = [p.per_rank.optimizer_bytes for p in plans]
    assert opt[0] == max(opt) and opt[-1] < opt[0]
    # Every valid element is owned by exactly one rank: state sums to the model's, plus the
    # copies of each 0-d parameter's state the other ranks hold ([Note: 0-d parameters]).
    counters = 4 * sum(1 for p in params if p.requires_grad)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    copies = (S - 1) * sum(1 for p in params if p.requires_grad and p.dim() == 0)
    assert sum(o - counters for o in opt) == 2 * 4 * (trainable + copies)


def test_units_and_params_match_a_hand_count() -> None:
    """The transformer policy makes one unit per block plus the root; the parameters are
    counted by hand from the GPT's layout (d=16, ffn 64, vocab 256, context 32)."""
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, d_model=16)
    model = meta_gpt(cfg)
    p = sw.plan(model, world_size=2)
    block = 2 * 16 + 4 * 16 * 16 + 2 * 16 * 64  # two norm gains, qkv + out, MLP in + out
    root = (256 + 32) * 16 + 16  # token and position tables (the head is tied), final norm
    assert p.units == 3 + 1
    assert p.params == root + 3 * block == 13_936
    assert p.params == sum(x.numel() for x in model.parameters())  # torch's own count
    assert p.shape["n_layers"] == 3 and p.shape["max_seq_len"] == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_formula_matches_saved_tensors(dtype: torch.dtype) -> None:
    """The per-token formula vs the tensors autograd actually saves on the real GPT."""
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64)
    B, T = 2, 64
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, torch.randint(0, cfg.vocab_size, (B, T)))
    shape = TransformerShape(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size,
                             max_seq_len=cfg.block_size)
    size = torch.empty((), dtype=dtype).element_size()
    formula = B * T * (cfg.n_layer * shape.block_activation_bytes(size)
                       + shape.root_activation_bytes(size))
    assert formula == pytest.approx(sum(saved.values()), rel=0.02)


def test_flops_match_the_model_and_comm_volumes() -> None:
    cfg = preset("124m")
    S, B = 8, 2
    p = sw.plan(meta_gpt(cfg), world_size=S, batch_size=B, seq_len=cfg.block_size,
                mixed_precision="bf16", device="a100-80gb")
    assert p.time.model_flops == pytest.approx(cfg.flops_per_token() * B * cfg.block_size)
    # Ring volumes: all-gather in bf16 forward (every unit) and backward (all but the
    # root, which stays unsharded); reduce-scatter of fp32 gradients.
    n = cfg.num_params()
    root = (cfg.vocab_size + cfg.block_size + 1) * cfg.d_model
    pad = p.per_rank.params_bytes * S / 4 - n  # padding rows, all ranks together
    assert 0 <= pad < 0.001 * n
    frac = (S - 1) / S
    assert p.comm.all_gather_bytes == pytest.approx(frac * 2 * (2 * n - root), rel=1e-3)
    assert p.comm.reduce_scatter_bytes == pytest.approx(frac * 4 * n, rel=1e-3)
    assert p.comm.sent_bytes == p.comm.received_bytes
    ns = sw.plan(meta_gpt(cfg), world_size=S, sharding_strategy="NO_SHARD",
                 mixed_precision="bf16")
    assert ns.comm.all_reduce_bytes == pytest.approx(2 * frac * 4 * n, rel=1e-6)
    assert ns.comm.all_gather_bytes == 0


def test_hybrid_splits_intra_and_inter_node_bytes() -> None:
    p = sw.plan(7e9, world_size=32, sharding_strategy="HYBRID_SHARD", mixed_precision="bf16",
                device="h100-80gb", interconnect="ib-200g", batch_size=1, seq_len=2048)
    c = p.comm
    assert (p.shard_size, p.replicate_size) == (8, 4)
    assert c.inter_node_bytes == c.all_reduce_bytes > 0
    assert c.intra_node_bytes == c.all_gather_bytes + c.reduce_scatter_bytes
    # The cross-node all-reduce carries one shard of the fp32 gradients: 2(R-1)/R of 4P/8.
    assert c.all_reduce_bytes == pytest.approx(2 * 3 / 4 * 4 * 7e9 / 8, rel=1e-3)


def test_time_model_shape_and_verdicts() -> None:
    fast = sw.plan(preset("7b").num_params(), world_size=8, mixed_precision="bf16",
                   device="h100-80gb", batch_size=4, seq_len=4096, shape=dict(
                       n_layers=32, d_model=4096, n_heads=32, vocab_size=32000))
    t = fast.time
    assert t.compute_s <= t.step_s_overlap <= t.step_s_serial
    assert t.step_s == t.step_s_overlap  # GPUs overlap
    assert t.bound == "compute" and 0.3 < t.mfu < 0.75
    slow = sw.plan(7e9, world_size=64, mixed_precision="bf16", device="h100-80gb",
                   interconnect="eth-25g", batch_size=1, seq_len=2048)
    assert slow.time.bound == "interconnect"
    assert "interconnect-bound" in slow.time.verdict and "eth-25g" in slow.time.verdict
    assert slow.comm.inter_node_bytes == slow.comm.sent_bytes


def test_fits_and_largest_batch() -> None:
    kw = dict(world_size=8, mixed_precision="bf16", device="a100-40gb", seq_len=2048,
              shape=dict(n_layers=32, d_model=4096, n_heads=32, vocab_size=32000))
    base = sw.plan(6.6e9, batch_size=1, **kw)
    b = base.max_batch_size
    assert b is not None and b >= 1
    assert sw.plan(6.6e9, batch_size=b, **kw).fits
    assert not sw.plan(6.6e9, batch_size=b + 1, **kw).fits
    # NO_SHARD needs 16 bytes x 6.6B per rank: nowhere near 40 GB.
    ns = sw.plan(6.6e9, batch_size=1, sharding_strategy="NO_SHARD", **kw)
    assert ns.fits is False and ns.max_batch_size == 0


def test_phase_peaks_and_options() -> None:
    kw = dict(world_size=8, mixed_precision="bf16", device="h100-80gb", batch_size=2,
              seq_len=4096)
    model = meta_gpt(preset("1b"))
    p = sw.plan(model, **kw)
    r = p.per_rank
    assert r.total_bytes == max(r.peak_forward_bytes, r.peak_backward_bytes, r.peak_step_bytes)
    assert r.peak_step_bytes >= r.model_states_bytes  # params + grads + state at the step
    assert r.peak_backward_bytes > r.activations_bytes
    ckpt = sw.plan(model, activation_checkpointing=True, **kw)
    assert ckpt.per_rank.activations_bytes < r.activations_bytes / 3  # the logits remain
    assert ckpt.time.hardware_flops > p.time.hardware_flops == p.time.model_flops
    sgo = sw.plan(model, sharding_strategy="SHARD_GRAD_OP", **kw)
    assert sgo.per_rank.unsharded_bytes > 5 * r.unsharded_bytes  # every unit kept gathered
    off = sw.plan(model, cpu_offload=True, **kw)
    # Offloaded gradients are copied out as exact shards, without the reduce flags.
    assert 0 <= r.model_states_bytes - off.per_rank.host_bytes < 1e-6 * r.model_states_bytes
    assert off.per_rank.total_bytes < r.total_bytes - r.model_states_bytes / 2
    assert off.time.offload_s > 0 == p.time.offload_s
    assert off.time.step_s > p.time.step_s + off.time.offload_s  # the host's Adam is slow


def test_to_dict_is_json() -> None:
    p = sw.plan(meta_gpt(preset("tiny")), world_size=2, batch_size=2, seq_len=64,
                device="h200-141gb")
    d = json.loads(json.dumps(p.to_dict()))
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes",
                "unsharded_bytes", "activations_bytes", "buffers_bytes", "total_bytes",
                "peak_forward_bytes", "peak_backward_bytes", "peak_step_bytes"):
        assert isinstance(d["per_rank"][key], int), key
    assert d["fits"] is True and d["time"]["step_s"] > 0


@pytest.mark.parametrize("kwargs, words", [
    (dict(sharding_strategy="ZERO3"), ["ZERO3", "FULL_SHARD", "HYBRID_SHARD"]),
    (dict(device="tpu-v5"), ["tpu-v5", *DEVICES]),
    (dict(device="h100", interconnect="carrier-pigeon", batch_size=1, seq_len=8),
     ["carrier-pigeon", "ib-400g", "eth-25g", "nvlink"]),
    (dict(optimizer="lion"), ["lion", "adamw", "sgd"]),
    (dict(world_size=0), ["world_size=0"]),
    (dict(batch_size=-1), ["batch_size=-1"]),
    (dict(world_size=12, sharding_strategy="HYBRID_SHARD", ranks_per_node=8),
     ["ranks_per_node=8", "world_size=12"]),
    (dict(mixed_precision="int8"), ["int8", "bf16"]),
])
def test_errors_name_the_value_and_the_choices(kwargs: dict, words: list[str]) -> None:
    args = {"world_size": 8, **kwargs}
    with pytest.raises(ValueError) as e:
        sw.plan(1e9, **args)
    for w in words:
        assert w in str(e.value)


def test_bad_counts_are_refused() -> None:
    for bad in (0, -5, "7b", None):
        with pytest.raises(ValueError, match="model_or_param_count"):
            sw.plan(bad, world_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smaller than the shape"):
        sw.plan(1e6, world_size=2, shape=dict(n_layers=4, d_model=1024, n_heads=8,
                                               vocab_size=1000))
