"""LoRA through peft on a meta-built sharded model, sw.save_adapter, and activation
checkpointing (issue 21)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.testing import run_distributed
from tests.dist.lora_workers import ac_parity, lora_materialize

pytest.importorskip("peft")


@pytest.mark.parametrize("world", [2, 3])
def test_materialized_lora_starts_as_the_base_and_saves_an_adapter(world: int,
                                                                   tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.hf_models import build

    res = run_distributed(lora_materialize, world, str(tmp_path), timeout_s=300)
    r0 = res[0]
    # Before the fix: max |lora_B| = 0.06 and the adapted model differed from the base.
    assert r0["b_max"] == 0.0 and r0["a_min"] > 0 and r0["same"]
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for key, value in r0["full"].items():
        stored = key.replace(".default.", ".")
        assert torch.equal(saved[stored], torch.tensor(value)), key
    assert "already exists" in r0["refused"]
    assert not (tmp_path / "adapter.partial").exists()
    model = PeftModel.from_pretrained(build("llama"), str(tmp_path / "adapter"))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().min()) >= 0.5 for p in lora_b)


def test_activation_checkpointing_gives_the_same_numbers() -> None:
    res = run_distributed(ac_parity, 2, timeout_s=300)
    for r in res:
        assert r[False] == pytest.approx(r[True], abs=1e-6)
