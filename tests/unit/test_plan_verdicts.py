"""`sw.plan` and `shardwise plan` never say a bare "fits" with activations left out (issue 16)."""

from __future__ import annotations

import subprocess
import sys

import torch

import shardwise as sw
from shardwise.planner import report
from shardwise.train.model import GPT, preset


def _gpt(name: str) -> GPT:
    with torch.device("meta"):
        return GPT(preset(name))


def test_a_model_with_a_context_length_plans_batch_1_at_it() -> None:
    p = sw.plan(_gpt("7b"), world_size=8, device="h100-80gb")
    context = preset("7b").block_size
    assert (p.batch_size, p.seq_len) == (1, context) and p.per_rank.activations_bytes
    assert p.verdict == "fits" and p.fits is True
    assert any(f"batch 1 x {context} tokens per rank, the model's context length" in n
               for n in p.notes)
    assert any("fused attention" in n for n in p.notes)
    # A batch alone takes the context length as its sequence.
    assert sw.plan(_gpt("7b"), world_size=8, batch_size=2).seq_len == context


def test_without_a_sequence_the_verdict_says_activations_are_unknown() -> None:
    p = sw.plan(70e9, world_size=64, device="h100-80gb", batch_size=2)
    assert p.fits is None and p.verdict == "model states fit; activations unknown"
    assert any("batch_size=2 without seq_len" in n for n in p.notes)
    text = str(p)
    assert "usable: model states fit; activations unknown" in text
    assert "usable: fits" not in text and "no batch_size and seq_len" not in text
    assert " GB" not in text  # binary units everywhere


def test_a_plan_that_does_not_fit_says_what_would() -> None:
    p = sw.plan(7e9, world_size=8, device="h100-80gb", batch_size=2, seq_len=4096)
    assert p.fits is False and p.verdict == "does not fit"
    changes = {a.change: a for a in p.alternatives}
    assert {"activation checkpointing", "CPU offload", "batch_size=1"} <= set(changes)
    assert any(c.startswith("world_size=") for c in changes)
    assert all(a.total_bytes < p.per_rank.total_bytes for a in p.alternatives)
    assert changes["activation checkpointing"].fits is True
    assert "what would fit instead" in str(p) and "activation checkpointing" in str(p)
    assert p.to_dict()["alternatives"][0]["change"] == p.alternatives[0].change


def test_print_plan_is_the_cli_table() -> None:
    argv = ["--model", "tiny", "--world-size", "2", "--device", "h100-80gb"]
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", *argv],
                         capture_output=True, text=True, timeout=120).stdout
    p = sw.plan(_gpt("tiny"), world_size=2, device="h100-80gb")
    table = "\n".join(report.table(p))
    assert table in out and table in str(p)
    assert "no batch_size and seq_len" not in out
