"""`--model.quantize nf4` in one process: its cross-checks and what the run reports holding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.train import options as O
from tests.hf_models import save_tiny

pytest.importorskip("peft")
pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny("llama", tmp_path_factory.mktemp("qlopt") / "llama")


def test_nf4_needs_lora_adapters_and_torchao(llama: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"model.hf": llama, "data.path": llama, "model.quantize": "nf4"}
    with pytest.raises(ValueError, match="model.quantize='nf4' needs lora.rank > 0"):
        O.build(base)
    assert O.build({**base, "lora.rank": "4"}).model.quantize == "nf4"
    with pytest.raises(ValueError, match="NO_SHARD is not supported"):
        O.build({**base, "lora.rank": "4", "shard.sharding_strategy": "NO_SHARD"})
    from shardwise.train import qlora

    monkeypatch.setattr(qlora, "missing", lambda *m: list(m))
    with pytest.raises(ValueError, match=r"needs torchao.*shardwise\[qlora\]"):
        O.build({**base, "lora.rank": "4"})


def test_training_state_counts_nf4_bytes_not_the_dtype() -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from shardwise.train.metrics import training_state_bytes

    lin = nn.Linear(256, 256, bias=False)
    lin.weight = nn.Parameter(to_nf4(lin.weight.detach()), requires_grad=False)
    model = nn.Sequential(lin, nn.Linear(256, 4, bias=False))
    local, full = training_state_bytes(model)
    # 4-bit codes (32 KiB), int8 scalers (1 KiB), factors, the 16 levels and the mean; then
    # the plain head with gradient and AdamW's two moments. Counted as fp32 before: 256 KiB.
    nf4 = 256 * 256 // 2 + 256 * 256 // 64 + 4 * 4 + 16 * 4 + 4
    assert local == full == nf4 + 256 * 4 * 4 * 4


def test_nf4_codes_made_in_pieces_equal_torchaos() -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from shardwise.checkpoint import quantize as Q

    # 3.25 pieces of 64K values (13 scaler blocks), bf16 as a QLoRA run loads them.
    w = torch.randn(832, 256, dtype=torch.bfloat16)
    codes, absmax = Q.rows_part(w, Q.NF4())
    assert w.numel() > 3 * Q._PIECE
    assert torch.equal(codes, to_nf4(w).quantized_data)
    assert torch.equal(absmax, w.reshape(-1, 64).abs().amax(dim=1))


def test_nf4_blocks_and_skipped_modules_from_the_command_line(llama: str) -> None:
    """Issue 42: the NF4 refusal suggested sw.NF4(block_size=...), which the CLI could not
    pass; --model.nf4_block_size, --model.nf4_scaler_block_size and --model.nf4_skip reach
    the loader's spec, and a bad value names the option."""
    from shardwise.checkpoint.quantize import NF4

    base = {"model.hf": llama, "data.path": llama, "model.quantize": "nf4", "lora.rank": "4"}
    assert O.build(base).model.nf4() == NF4()
    cfg = O.build({**base, "model.nf4_block_size": "32", "model.nf4_scaler_block_size": "8",
                   "model.nf4_skip": "lm_head, mlp.down_proj"})
    assert cfg.model.nf4() == NF4(32, 8, ("lm_head", "mlp.down_proj"))
    with pytest.raises(ValueError, match="model.nf4_block_size=3 is not allowed"):
        O.build({**base, "model.nf4_block_size": "3"})
    assert "--model.nf4_block_size" in O.help_text()
