"""Review: the merged LoRA export must equal peft's merge (W + scale * delta, oriented as
the layer stores W). GPT-2's Conv1D stores W as (in, out): peft adds (B @ A).T there
(fan_in_fan_out); hf_export._merged added B @ A untransposed, which for a square Conv1D
(attn.c_proj) was silently the wrong matrix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import hf_models as H
from tests.dist import review_pretrained_workers as W


@pytest.mark.parametrize("kind,targets", [("llama", "q_proj,v_proj"), ("gpt2", "attn.c_proj")])
def test_merged_lora_export_equals_peft_merge(kind: str, targets: str, tmp_path: Path) -> None:
    folder = H.save_tiny(kind, tmp_path / kind, tie_word_embeddings=False)
    data = tmp_path / "data.txt"
    data.write_text("hello world\n")
    d = W.merged_vs_peft(folder, targets, str(data), str(tmp_path / "runs" / "merged"))
    assert d["weights"] <= 1e-6 and d["logits"] <= 1e-5, d
