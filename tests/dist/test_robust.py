"""The engine on models and patterns outside the parity grid."""

from __future__ import annotations

import pytest

from shardwise.testing import run_distributed
from tests.dist import robust


@pytest.mark.parametrize("world", [2, 3])
def test_checkpointing_reuse_eval_and_dict_outputs(world: int) -> None:
    for res in run_distributed(robust.checkpointing_and_reuse, world):
        assert max(res.values()) < 1e-5


def test_hugging_face_models() -> None:
    pytest.importorskip("transformers", reason="transformers is in the test extras")
    for res in run_distributed(robust.hf_models, 2):
        assert max(res.values()) < 2e-5
