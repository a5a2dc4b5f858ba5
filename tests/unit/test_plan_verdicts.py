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
    # Cheapest first: the fp32 default's bf16 before checkpointing, accumulation, TP and
    # offload; each fits, with its total and step time.
    assert [a.change for a in p.alternatives] == [
        "bf16 mixed precision", "activation checkpointing",
        "micro-batch 1 x 2 accumulation steps", "tensor_parallel=2 (inside a node)",
        "CPU offload"]
    for a in p.alternatives:
        assert a.fits is True and a.total_bytes <= p.usable_bytes and a.step_s > 0
    # The figures are those of the plan with the change.
    ac = sw.plan(7e9, world_size=8, device="h100-80gb", batch_size=2, seq_len=4096,
                 activation_checkpointing=True)
    assert p.alternatives[1].total_bytes == ac.per_rank.total_bytes
    assert p.alternatives[1].step_s == ac.time.step_s
    micro = sw.plan(7e9, world_size=8, device="h100-80gb", batch_size=1, seq_len=4096)
    assert p.alternatives[2].step_s == 2 * micro.time.step_s  # two passes per step
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
