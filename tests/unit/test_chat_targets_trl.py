"""Issue 42: the loss targets of chat and prompt/completion records are exactly TRL's SFT
(`assistant_only_loss=True`; `completion_only_loss` for prompt/completion) on the same
tokenizer and chat template. TRL builds its dataset here (SFTTrainer on a tiny Llama, nothing
downloaded); shardwise's Encoder must give the same input ids and the same mask. Before the
fix shardwise also trained on the newline after each reply's end token and on an EOS it
added to every conversation."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shardwise.train import hf_data as H
from tests.hf_tokenizer import MARKED_CHAT_TEMPLATE, VOCAB_SIZE, make_tokenizer

pytest.importorskip("trl")

CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "It is 5."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue"},
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Red, or green."}],
    [{"role": "user", "content": "def f(x): return x"},
     {"role": "assistant", "content": "  indented\nreply  "},
     {"role": "user", "content": "thanks"}],
]
PCS = [{"prompt": "The capital of France is", "completion": " Paris."},
       {"prompt": "def add(a, b):\n    return", "completion": " a + b\n"},
       {"prompt": "x =", "completion": "1<|endoftext|>"}]


def _trl(tmp: Path, tok: Any, records: list[dict[str, Any]]) -> list[tuple[list[int],
                                                                             list[int]]]:
    """(input_ids, mask) of each record as TRL's SFTTrainer prepares it."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.hf_models import build

    chat = "messages" in records[0]
    args = SFTConfig(output_dir=str(tmp), assistant_only_loss=chat, report_to="none",
                     max_length=None, packing=False, use_cpu=True)
    trainer = SFTTrainer(model=build("llama", vocab_size=VOCAB_SIZE), args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tok)
    # TRL folds its assistant / completion mask into the labels (-100: not a target).
    return [(r["input_ids"], [int(v != -100) for v in r["labels"]])
            for r in trainer.train_dataset]


def _ours(tok: Any, docs: list[Any]) -> list[tuple[list[int], list[int]]]:
    enc = H.Encoder(tok).encode(docs, [f"record {i}" for i in range(len(docs))])
    return [(e.ids.tolist(), e.mask.tolist()) for e in enc]


def test_chat_targets_equal_trl_assistant_only_loss(tmp_path: Path) -> None:
    tok = make_tokenizer()
    tok.chat_template = MARKED_CHAT_TEMPLATE
    want = _trl(tmp_path, tok, [{"messages": m} for m in CHATS])
    assert _ours(tok, [("chat", m) for m in CHATS]) == want
    # The targets are each reply and its <|end|>: never the newline after it.
    ids, mask = want[0]
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "It is 5.<|end|>"


def test_unmarked_template_counts_what_the_markers_would(tmp_path: Path, caplog) -> None:
    """The same layout without `{% generation %}`: the fallback rule (end of the generation
    prompt to the end of the turn, trailing whitespace excluded) gives TRL's targets of the
    marked template, and a warning says the template cannot mark them."""
    marked = make_tokenizer()
    marked.chat_template = MARKED_CHAT_TEMPLATE
    want = _ours(marked, [("chat", m) for m in CHATS])
    with caplog.at_level(logging.WARNING, logger="shardwise.train.hf_data"):
        got = _ours(make_tokenizer(), [("chat", m) for m in CHATS])
    assert got == want
    assert "no {% generation %} markers" in caplog.text


def test_prompt_completion_targets_equal_trl_completion_only_loss(tmp_path: Path) -> None:
    tok = make_tokenizer()
    want = _trl(tmp_path, tok, PCS)
    assert _ours(tok, [("pc", r["prompt"], r["completion"]) for r in PCS]) == want
    assert all(np.asarray(m)[-1] == 1 and i[-1] == tok.eos_token_id for i, m in want)
