"""MFU's parts: FLOPs per token counted by hand and by torch's FlopCounterMode on the real
models, the peak table and its override, the CPU's measured peak, and the arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardwise.observe import peak_flops as P
from shardwise.train import options as O
from shardwise.train.flops import Utilization, flops_per_token
from shardwise.train.model import GPT
from tests import hf_models
from tests.hf_tokenizer import save_tokenizer


def counted_per_token(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Forward + backward FLOPs per token as torch counts the ops that ran. The math SDPA
    kernel runs attention as two batched matmuls over the full T x T scores, which the
    counter sees (it has no formula for the fused CPU kernel)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logits.float().sum().backward()
    return fc.get_total_flops() / x.numel()


def test_builtin_gpt_by_hand_and_by_counter() -> None:
    cfg = O.build({"model.preset": "tiny"})  # vocab 256, T 64, 2 layers, d 64, ffn 256
    # Matmul weights, by hand: per block q,k,v (3 x 64x64) + out (64x64) + MLP (2 x 64x256),
    # and the tied head (256x64); the position table and token lookups do no matmul.
    block = 3 * 64 * 64 + 64 * 64 + 2 * 64 * 256  # 49,152
    matmul = 2 * block + 256 * 64  # 114,688
    # Attention per layer: QK^T and AV, 2 x T x d each forward, x3 forward + backward,
    # halved for the causal mask: 6 x T x d.
    attention = 2 * 6 * 64 * 64  # 49,152
    got, _ = flops_per_token(cfg)
    assert got == 6 * matmul + attention == 737_280
    torch.manual_seed(0)
    model = GPT(cfg.model.gpt())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randint(0, 256, (2, 64))
    # The counter sees full (not causal) attention: twice our attention term.
    assert counted_per_token(model, x) == 6 * matmul + 2 * attention


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = hf_models.save_tiny("llama", tmp_path_factory.mktemp("m") / "llama")
    save_tokenizer(folder)
    return folder


def test_hf_llama_by_hand_and_by_counter(llama_folder: str, tmp_path: Path) -> None:
    data = tmp_path / "d.txt"
    data.write_text("hello world\n" * 50)
    cfg = O.build({"model.hf": llama_folder, "data.path": str(data), "model.block_size": "16"})
    # Llama tiny: d 24, 4 heads of 6 (q 24), 2 kv heads (kv 12), SwiGLU 40, 2 layers,
    # vocab 53, untied head. Per block: q (24x24) + k, v (2 x 24x12) + o (24x24) + gate, up,
    # down (3 x 24x40) = 4,608; the head 53x24.
    block = 24 * 24 + 2 * 24 * 12 + 24 * 24 + 3 * 24 * 40
    matmul = 2 * block + 53 * 24
    attention = 2 * 6 * 16 * 24
    got, _ = flops_per_token(cfg)
    assert got == 6 * matmul + attention == 6 * 10_488 + 4_608
    model = hf_models.reference(llama_folder)
    x = torch.randint(0, 53, (2, 16))
    assert counted_per_token(model, x) == 6 * matmul + 2 * attention
    # LoRA: the frozen weights need no weight gradient (4 each), the adapters 6 each.
    lora = O.build({"model.hf": llama_folder, "data.path": str(data), "model.block_size": "16",
                    "lora.rank": "2", "lora.targets": "q_proj,v_proj"})
    # Per layer: q's A (2x24) and B (24x2), v's A (2x24) and B (12x2); 2 layers.
    adapters = 2 * ((2 * 24 + 24 * 2) + (2 * 24 + 12 * 2))  # 336
    assert flops_per_token(lora, adapters)[0] == 4 * matmul + 6 * adapters + attention


def test_unknown_architecture_reports_no_mfu(tmp_path: Path, llama_folder: str) -> None:
    import json
    import shutil

    folder = tmp_path / "odd"
    shutil.copytree(llama_folder, folder)
    cfg_json = json.loads((folder / "config.json").read_text())
    data = tmp_path / "d.txt"
    data.write_text("hello world\n" * 50)
    cfg = O.build({"model.hf": str(folder), "data.path": str(data), "model.block_size": "16"})
    cfg_json["model_type"], cfg_json["architectures"] = "mamba", ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg_json))
    flops, why = flops_per_token(cfg)
    assert flops is None and "FLOPs per token unknown" in why
    u = Utilization.for_run(cfg, 0, torch.device("cpu"), 2)
    assert u.figures(1000.0) == {} and u.info()["flops_per_token"] is None


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
    ("NVIDIA H100 NVL", torch.bfloat16, 835.0),
    ("NVIDIA H100 PCIe", torch.float32, 51.2),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A10", torch.float16, 125.0),
    ("NVIDIA L40S", torch.bfloat16, 362.1),
    ("NVIDIA L4", torch.bfloat16, 121.0),
    ("AMD Instinct MI300X", torch.float32, 163.4),
])
def test_peak_table_picks_the_most_specific_name(name: str, dtype: torch.dtype,
                                                 tflops: float) -> None:
    assert P.table_peak(name, dtype) == pytest.approx(tflops * 1e12)


def test_peak_override_and_cpu_measurement() -> None:
    assert P.table_peak("Some Future GPU", torch.bfloat16) is None
    assert P.peak_flops(torch.device("cpu"), torch.float32, 2.5) == (2.5e12,
                                                                     "given (log.peak_tflops)")
    peak, source = P.peak_flops(torch.device("cpu"), torch.float32)
    # Any CPU does at least 0.1 GFLOP/s and no CPU 100 TFLOP/s of fp32 matmul per process.
    assert 1e8 < peak < 1e14 and source.startswith("measured matmul")


def test_mfu_arithmetic() -> None:
    u = Utilization(flops_per_token=1e6, peak_flops=1e11, peak_source="x", world=4)
    # 40,000 tokens/s over 4 devices = 10,000 each; x 1e6 FLOPs = 1e10 FLOP/s = 10% of 1e11.
    got = u.figures(40_000.0)
    assert got["tflops"] == pytest.approx(0.01) and got["mfu_pct"] == pytest.approx(10.0)
