"""Real clients: Hugging Face Llama and Qwen2 from configs, and peft LoRA on Qwen2."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist.hf_workers import hf_parity

CASES = (("llama", False, "FULL_SHARD"), ("qwen2", False, "SHARD_GRAD_OP"),
         ("qwen2", True, "FULL_SHARD"), ("qwen2", True, "SHARD_GRAD_OP"))


@pytest.mark.parametrize("world", [2, 3])
def test_hf_models_and_peft_lora(world: int) -> None:
    run_distributed(hf_parity, world, CASES, timeout_s=600)
