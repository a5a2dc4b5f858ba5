"""`shardwise train --model.hf` options in one process: LoRA targets, options that do not
apply to a Hugging Face run, the fine-tuning defaults, relative paths, the `hf` extra."""

from __future__ import annotations

import pytest

from shardwise.train import options as O
from tests.hf_models import save_tiny

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny("llama", tmp_path_factory.mktemp("hfopt") / "llama")


def _lora(llama: str, targets: str):  # noqa: ANN202 - a Config
    return O.build({"model.hf": llama, "data.path": llama, "lora.rank": 2,
                    "lora.targets": targets})


def test_a_lora_target_that_matches_nothing_is_refused_by_name(llama: str) -> None:
    from shardwise.train.hf_model import _meta_model

    # peft alone adapts q_proj and drops `nonexistent` without a word.
    with pytest.raises(ValueError) as e:
        _meta_model(_lora(llama, "q_proj,nonexistent"))
    msg = str(e.value)
    assert "'nonexistent' matches no module" in msg and "q_proj" not in msg.split(":")[1]
    for layer in ("q_proj", "v_proj", "gate_proj", "lm_head"):
        assert layer in msg.split("adaptable layers are:")[1], msg


def test_lora_targets_match_a_tail_or_a_full_name(llama: str) -> None:
    from shardwise.train.hf_model import _meta_model

    model = _meta_model(_lora(llama, "self_attn.q_proj,v_proj"))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_modules()
               if n.endswith("lora_A")}
    assert adapted == {"q_proj", "v_proj"}
