"""QLoRA from a Hugging Face folder (issue 36): `sw.load_pretrained(..., quantize=...)` gives
each rank torchao's NF4 chunk of every frozen linear weight, reading only its rows, and the
model trains as an unsharded QLoRA model and as torch's FSDP2 with the same client code."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist.qlora_workers import STEPS, load_nf4, save_folder

pytest.importorskip("peft")
pytest.importorskip("torchao")


@pytest.mark.parametrize("world", [2, 3])
def test_nf4_load_equals_to_nf4_and_trains_as_fsdp2_and_unsharded(world: int,
                                                                   tmp_path: Path) -> None:
    folder = save_folder(str(tmp_path / "llama"))
    res = run_distributed(load_nf4, world, folder, timeout_s=300)
    for r in res:
        assert "16384" in r["refused"] and "q_proj" in r["refused"], r["refused"]
        # Every linear weight of the two blocks (7 each), not the head.
        assert len(r["quantized"]) == 14 and not any("lm_head" in k for k in r["quantized"])
        assert r["mismatched"] == []
        assert r["byte_share"] == pytest.approx(1 / world)
        assert r["dequant_diff"] == 0.0
        assert r["logits_diff"] < 1e-5
        assert len(r["sw"]) == STEPS
        for a, b, c in zip(r["sw"], r["fsdp2"], r["ref"]):
            assert abs(a - c) < 1e-5 and abs(a - b) < 1e-5, (r["sw"], r["fsdp2"], r["ref"])
        assert r["adapter_diff"] < 1e-5
