"""Issue 24: planning from a Hugging Face config.json (GQA, SwiGLU, tied/untied, biases,
MoE), tensor-parallel memory, suggestions that fit and notes for unused options.

Parameter counts are checked two ways: against the model `transformers` builds from the
same config on the meta device (nothing allocated; exact), and term by term against a
hand count written out below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.commands.plan import main
from shardwise.planner import TransformerShape
from shardwise.planner.hf_config import PRESETS, load_shape, read_config

transformers = pytest.importorskip("transformers")

TINY = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 100},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 100},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                "vocab_size": 100},
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 32, "vocab_size": 100},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
             "vocab_size": 100, "n_positions": 16},
    # Variants: every bias Llama can carry, a tied Qwen2.
    "llama-biased": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 100,
                     "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    "qwen2-tied": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                   "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                   "vocab_size": 100, "tie_word_embeddings": True},
}
# Real sizes: the presets plus the published configs of GPT-2 (124M), Gemma 7B, Mistral 7B.
REAL = {
    **{name: read_config(name)[0] for name in PRESETS},
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
             "vocab_size": 50257, "n_positions": 1024},
    "gemma-7b": {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576,
                 "num_hidden_layers": 28, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000,
                 "max_position_embeddings": 8192},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32000,
                   "max_position_embeddings": 32768},
}


def meta_model(cfg: dict) -> torch.nn.Module:
    hf = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        # fp32 parameters, as training keeps them (a config's torch_dtype is for inference)
        return transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)


@pytest.mark.parametrize("name", [*TINY, *(f"real/{n}" for n in REAL)])
def test_param_count_equals_the_meta_model(name: str) -> None:
    cfg = REAL[name[5:]] if name.startswith("real/") else TINY[name]
    shape, _ = load_shape(cfg)
    model = meta_model(cfg)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    # The plan of the config and the plan of the model agree on every unit's size.
    assert sw.plan(cfg, world_size=8).params == sw.plan(model, world_size=8).params


def test_presets_are_the_published_sizes() -> None:
    sizes = {n: load_shape(n)[0].params() for n in PRESETS}
    assert sizes == {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
                     "llama3-405b": 405_853_388_800, "qwen2-7b": 7_615_616_512,
                     "mixtral-8x7b": 46_702_792_704}


def test_hand_count_llama_gqa_swiglu_untied() -> None:
    s, _ = load_shape(TINY["llama"])
    d, f, V, L, hd = 64, 96, 100, 2, 8
    q, kv = 8 * hd, 2 * hd  # 8 query heads, 2 kv heads
    assert (s.q_dim, s.kv_dim, s.mlp, s.tied) == (q, kv, "gated", False)
    assert s.attention_params() == d * q + d * kv + d * kv + q * d  # q, k, v, o
    assert s.mlp_params() == 3 * d * f  # gate, up, down
    assert s.block_params() == s.attention_params() + s.mlp_params() + 2 * d  # 2 RMSNorms
    assert s.root_params() == V * d + V * d + d  # embedding, untied head, final norm
    assert s.params() == L * (d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d) + 2 * V * d + d
    # A transformers config object plans the same as its dict.
    obj = transformers.LlamaConfig(**{k: v for k, v in TINY["llama"].items()
                                      if k != "model_type"})
    assert sw.plan(obj, world_size=2).params == s.params() == 70_464


def test_hand_count_biases_norms_and_tying() -> None:
    d, f, V = 64, 96, 100
    qwen = load_shape(TINY["qwen2"])[0]
    assert qwen.qkv_bias and not qwen.out_bias
    assert qwen.attention_params() == (d * 64 + 2 * d * 16 + 64 * d) + (64 + 16 + 16)
    assert load_shape(TINY["qwen2-tied"])[0].root_params() == V * d + d
    biased = load_shape(TINY["llama-biased"])[0]
    assert biased.attention_params() == 4 * d * d + 3 * d + d  # q, k, v and o biases
    assert biased.mlp_params() == 3 * d * f + 2 * f + d  # gate, up and down biases
    g2 = load_shape(TINY["gpt2"])[0]
    d2, f2, P = 32, 128, 16  # n_inner defaults to 4 x n_embd
    assert g2.block_params() == (2 * 2 * d2  # two LayerNorms, weight and bias
                                 + d2 * 3 * d2 + 3 * d2  # c_attn
                                 + d2 * d2 + d2  # attention c_proj
                                 + d2 * f2 + f2 + f2 * d2 + d2)  # c_fc, mlp c_proj
    assert g2.root_params() == V * d2 + P * d2 + 2 * d2  # tied wte, wpe, ln_f
    gemma = load_shape(TINY["gemma"])[0]
    assert gemma.q_dim == 4 * 32 != gemma.d_model and gemma.tied
    assert gemma.attention_params() == d * 128 + 2 * d * 32 + 128 * d


def test_hand_count_moe_memory_all_experts_flops_active_ones() -> None:
    s = load_shape(TINY["mixtral"])[0]
    d, f, E, k, q, kv = 64, 96, 4, 2, 64, 16
    assert s.mlp_params() == E * 3 * d * f + d * E  # every expert, and the router
    attention = 2 * d * q + 2 * d * kv
    assert s.block_matmul_params() == attention + k * 3 * d * f + d * E  # top-k experts
    p = sw.plan(TINY["mixtral"], world_size=1, batch_size=1, seq_len=8, device="h100-80gb")
    assert p.params == s.params()
    tokens = 8
    expected = 2 * (6 * (attention + k * 3 * d * f + d * E) + 6 * 8 * q) + 6 * 100 * d
    assert p.time is not None and p.time.model_flops == pytest.approx(expected * tokens)
    # Memory: all experts (fp32 masters of every parameter, one rank).
    assert p.per_rank.params_bytes == 4 * s.params()


def test_meta_llama_70b_plans_as_its_config() -> None:
    """The same numbers from the meta-built model and from the config, at tp 1 and 8."""
    model = meta_model(REAL["llama3-70b"])
    for tp, emb in ((1, "split"), (8, "replicate"), (8, "split")):
        kw = dict(world_size=64, mixed_precision="bf16", tensor_parallel=tp,
                  tp_embeddings=emb)
        a, b = sw.plan(model, **kw).per_rank, sw.plan("llama3-70b", **kw).per_rank
        assert (a.params_bytes, a.grads_bytes, a.optimizer_bytes) == (
            b.params_bytes, b.grads_bytes, b.optimizer_bytes), (tp, emb)


def _per_tp_rank(s: TransformerShape, tp: int, split_tables: bool, extra: int = 0) -> int:
    """Parameters on one TP rank: block matrices / tp, norms whole, embedding and head
    whole unless split."""
    norms = s.n_layers * 2 * s.norm_params() + s.norm_params()
    matrices = s.n_layers * (s.block_params() - 2 * s.norm_params()) + extra
    tables = s.root_params() - s.norm_params()
    return matrices // tp + norms + (tables // tp if split_tables else tables)


@pytest.mark.parametrize("split_tables", [False, True])
def test_tp_model_states_are_bytes_x_params_per_tp_rank_over_dp(split_tables: bool) -> None:
    s, _ = load_shape("llama3-70b")
    for tp in (1, 2, 8):
        dp = 64 // tp
        p = sw.plan("llama3-70b", world_size=64, mixed_precision="bf16", tensor_parallel=tp,
                    tp_embeddings="split" if split_tables else "replicate")
        r = p.per_rank
        tensors = 2 + 9 * s.n_layers + (0 if s.tied else 1)  # Adam's step counters
        per_rank = _per_tp_rank(s, tp, split_tables and tp > 1) / dp  # every size divides
        assert r.params_bytes == 4 * per_rank  # fp32 master shard
        assert r.optimizer_bytes == 8 * per_rank + 4 * tensors  # two fp32 moments
        assert 0 <= r.grads_bytes - 4 * per_rank <= 4 * tensors  # + "has a grad" flags


def test_the_reported_tp_bug() -> None:
    """70e9 parameters with Llama 70B's dimensions: tp 8 doubled the model states (34.14 GiB
    vs 16.30 at tp 1): the parameters the shape does not explain were not divided by tp."""
    shape = dict(n_layers=80, d_model=8192, n_heads=64, vocab_size=128256, ffn_dim=28672)
    kw = dict(world_size=64, device="h100-80gb", interconnect="ib-400g",
              mixed_precision="bf16", batch_size=1, seq_len=4096, shape=shape)
    one = sw.plan(70e9, **kw).per_rank.model_states_bytes
    eight = sw.plan(70e9, tensor_parallel=8, tp_embeddings="replicate", **kw).per_rank
    s = TransformerShape(**shape)
    extra = int(70e9) - s.params()
    per_rank = _per_tp_rank(s, 8, False, extra) / 8
    assert eight.params_bytes == pytest.approx(4 * per_rank, abs=4 * 80)
    assert eight.model_states_bytes < 1.15 * one  # the whole embedding on every TP rank
    split = sw.plan(70e9, tensor_parallel=8, **kw).per_rank  # the default: split
    assert split.model_states_bytes == pytest.approx(16 * 70e9 / 64, rel=2e-3)
    assert one == pytest.approx(16 * 70e9 / 64, rel=1e-6)


def test_suggestions_fit_cheapest_first() -> None:
    """13B on 8 x A100-40GB (fp32 by default) hears about bf16 and TP; the 70B at tp 1 never
    hears of a world size beyond 16,384 or of anything that does not fit."""
    with torch.device("meta"):
        from shardwise.train.model import GPT, preset

        model = GPT(preset("13b"))
    p = sw.plan(model, world_size=8, device="a100-40gb")
    assert p.fits is False and p.alternatives
    changes = [a.change for a in p.alternatives]
    assert any("bf16" in c for c in changes) and any("tensor_parallel" in c for c in changes)
    for a in p.alternatives:
        assert a.fits is True and a.total_bytes <= p.usable_bytes and a.step_s > 0
    big = sw.plan(70e9, world_size=64, device="h100-80gb", mixed_precision="bf16",
                  batch_size=1, seq_len=4096,
                  shape=dict(n_layers=80, d_model=8192, n_heads=64, vocab_size=128256,
                             ffn_dim=28672))
    assert big.alternatives and all(a.fits for a in big.alternatives)
    for a in big.alternatives:
        for part in a.change.split(" + "):
            if part.startswith("world_size="):
                assert int(part.split("=")[1].replace(",", "")) <= 16_384
    # Two blocks of 206B parameters each: one gathered block outgrows an H100 at any scale.
    huge = TransformerShape(n_layers=2, d_model=131072, n_heads=128, vocab_size=32000)
    nothing = sw.plan(huge, world_size=8, device="h100-80gb", batch_size=1, seq_len=128)
    assert nothing.alternatives == () and any("nothing fits" in n for n in nothing.notes)


def test_unused_options_say_so() -> None:
    p = sw.plan("llama3-8b", world_size=8, device="h100-80gb", interconnect="ib-400g",
                sequence_parallel=True, tp_embeddings="replicate")
    notes = "\n".join(p.notes)
    assert "interconnect='ib-400g' is unused: all 8 ranks fit in one node" in notes
    assert "sequence_parallel is unused" in notes
    assert "tp_embeddings='replicate' is unused" in notes
    cpu = sw.plan(1e6, world_size=2, device="cpu", cpu_offload=True)
    assert any("cpu_offload is unused" in n for n in cpu.notes)
    assert not any("unused" in n for n in sw.plan("llama3-8b", world_size=16,
                                                 device="h100-80gb",
                                                 interconnect="ib-400g").notes)


def test_cli_config_preset_and_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(REAL["qwen2-7b"]))
    got = []
    for argv in (["--config", "qwen2-7b"], ["--model", "Qwen2-7B"], ["--config", str(folder)],
                 ["--config", str(folder / "config.json")]):
        assert main([*argv, "--world-size", "16", "--tp", "4", "--mixed-precision", "bf16",
                     "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out))
    assert all(g["per_rank"] == got[0]["per_rank"] for g in got)
    assert got[0]["params"] == 7_615_616_512 and got[0]["shape"]["n_kv_heads"] == 4
    assert main(["--config", "llama3-8b", "--world-size", "8", "--device", "h100-80gb",
                 "--interconnect", "ib-400g"]) == 0
    out = capsys.readouterr().out
    assert "config llama3-8b (8.03B params, 33 units)" in out
    assert "interconnect='ib-400g' is unused" in out


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                        ("mixtral", torch.float32)])
def test_activation_formula_vs_hf_blocks(arch: str, dtype: torch.dtype) -> None:
    """The per-token activation terms are measured on our GPT (test_plan.py); Hugging Face's
    Llama and Mixtral blocks keep more (RMSNorm's normalized copy, rotary embeddings'
    rotated q and k): measured here at 1.15-1.26x the formula, which the plan therefore
    underestimates for them (docs/plan.md, Limits). The test pins that ratio."""
    cfg = {**TINY[arch], "hidden_size": 256, "intermediate_size": 512,
           "vocab_size": 1000}
    hf = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype,
                                                          attn_implementation="sdpa")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    B, T = 2, 64
    idx = torch.randint(0, 1000, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=idx, labels=idx)
    s, _ = load_shape(cfg)
    size = torch.empty((), dtype=dtype).element_size()
    formula = B * T * (s.n_layers * s.block_activation_bytes(size)
                       + s.root_activation_bytes(size))
    assert 1.1 <= sum(saved.values()) / formula <= 1.3
