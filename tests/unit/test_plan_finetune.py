"""`shardwise plan` of a fine-tune (LoRA, QLoRA) as `shardwise train` runs it, in one process.

The NF4 byte counts equal torchao's own tensors; the dequantization figure is measured on
torchao; the CLI builds the run's meta model with train's own builder and plans it at the
run's training length, with the adapters' optimizer state counted by hand. The 2-rank
comparison with a measured run is tests/dist/test_plan.py's.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("peft")

from shardwise.checkpoint.quantize import NF4, frozen_linears, nf4_bytes  # noqa: E402
from shardwise.planner.memory import dequant_bytes  # noqa: E402
from shardwise.train.metrics import stored_bytes  # noqa: E402


@pytest.mark.parametrize("shape,spec,dtype", [
    ((96, 48), NF4(16, 4), torch.float32), ((512, 256), NF4(), torch.float32),
    ((256, 512), NF4(32, 8), torch.bfloat16)])
def test_nf4_bytes_are_torchaos(shape: tuple[int, int], spec: NF4,
                                dtype: torch.dtype) -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    t = to_nf4(torch.randn(*shape).to(dtype), spec.block_size, spec.scaler_block_size)
    planned = nf4_bytes(t.numel(), spec, dtype)
    assert planned == {n: stored_bytes(getattr(t, n)) for n in t.__tensor_flatten__()[0]}


def test_dequantization_peak_is_torchaos() -> None:
    """[Note: NF4 dequantization]: the planner's bytes per value against a linear layer over
    a torchao NF4 weight, measured in a fresh process whose freed blocks leave RSS."""
    code = ("from tests.dist.plan_workers import follow_live_bytes; follow_live_bytes(True)\n"
            "import torch; from shardwise.planner.measure import measure_dequant_bytes\n"
            "print(measure_dequant_bytes(torch.float32, 1024, 2048), "
            "measure_dequant_bytes(torch.bfloat16, 1024, 2048))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    fp32, bf16 = (float(x) for x in out[-2:])
    assert fp32 == pytest.approx(dequant_bytes(1, torch.float32), rel=0.05)  # 20
    assert bf16 == pytest.approx(dequant_bytes(1, torch.bfloat16), rel=0.05)  # 14


def test_nf4_skip_names_an_adapted_module_as_the_user_does() -> None:
    """peft wraps an adapted linear (`q_proj.base_layer`): `skip=("q_proj",)` keeps q_proj's
    base in the model's dtype, as it keeps an unadapted `down_proj` (the loader quantized
    it anyway, while `export --hf` took it as kept)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from tests.hf_models import tiny_config

    with torch.device("meta"):
        model = get_peft_model(tf.AutoModelForCausalLM.from_config(tiny_config("llama")),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    names = [n for n, _ in frozen_linears(model, NF4(skip=("lm_head", "q_proj", "down_proj")))]
    assert names and not any("q_proj" in n or "down_proj" in n for n in names), names
    assert any(n.endswith("v_proj.base_layer") for n in names), names


def _plan(*argv: str) -> dict:
    from shardwise.commands.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def test_cli_plans_a_qlora_run_as_train_runs_it(tmp_path: Path) -> None:
    """--model.hf with train's options: the run's training length (the model's 32
    positions, not a 131,072-token context) at batch 1, the NF4 base, and the adapters'
    AdamW state by hand."""
    from tests.dist.qlora_workers import save_folder

    folder = save_folder(str(tmp_path / "llama"))  # hidden 48, MLP 96, kv 24, 2 layers
    p = _plan("--model.hf", folder, "--lora.rank", "4", "--model.quantize", "nf4",
              "--model.nf4_block_size", "16", "--model.nf4_scaler_block_size", "4",
              "--world-size", "2")
    r = p["per_rank"]
    assert (p["batch_size"], p["seq_len"]) == (1, 32)
    # q_proj and v_proj adapted in 2 layers: A (4, 48) twice, B (48, 4) and (24, 4): 672
    # values a layer, half of each on a rank; AdamW: 2 fp32 moments + a step per tensor.
    assert r["optimizer_bytes"] == 2 * 4 * 672 + 4 * 8
    assert r["params_bytes"] - r["frozen_bytes"] == 4 * 672
    # The largest NF4 weight, gate/up (96, 48), dequantized in fp32.
    assert r["dequant_bytes"] == dequant_bytes(96 * 48, torch.float32)
    spec = NF4(16, 4)
    nf4 = 2 * sum(sum(nf4_bytes(n // 2, spec, torch.float32).values())
                  for n in (48 * 48, 24 * 48, 24 * 48, 48 * 48, 96 * 48, 96 * 48, 48 * 96))
    plain = 2 * 27 * 48 * 4 + 5 * 24 * 4  # embedding and head (53 rows: 27 a rank), norms
    assert r["frozen_bytes"] == nf4 + plain
    lora = _plan("--model.hf", folder, "--lora.rank", "4", "--world-size", "2")["per_rank"]
    assert lora["dequant_bytes"] == 0 and lora["optimizer_bytes"] == r["optimizer_bytes"]
    assert lora["frozen_bytes"] > r["frozen_bytes"]  # fp32 base linears instead of NF4
