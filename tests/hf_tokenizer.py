"""A small BPE tokenizer for tests, trained here on the standard library's own sources (nothing
is downloaded), saved as a Hugging Face tokenizer folder.

    from tests.hf_tokenizer import save_tokenizer, VOCAB_SIZE
    folder = save_tokenizer(tmp_path / "model")                       # with a chat template
    folder = save_tokenizer(tmp_path / "plain", chat_template=False)  # without one

The folder loads with `AutoTokenizer.from_pretrained(folder, local_files_only=True)`; a model
saved next to it needs `vocab_size >= VOCAB_SIZE`. Training takes ~50 ms and is done once per
process.
"""

from __future__ import annotations

import functools
import inspect
import json
import string
import textwrap
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512  # including SPECIAL_TOKENS
EOS, PAD = "<|endoftext|>", "<|pad|>"
# The chat template's markers are single tokens, as in real chat tokenizers.
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (EOS, PAD, *ROLE_TOKENS)
# ChatML-like: <|role|>content<|end|> then a newline, per message; the generation prompt
# is <|assistant|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The same layout with `{% generation %}` blocks around each assistant reply and its <|end|>
# (what TRL's assistant_only_loss and transformers' return_assistant_tokens_mask read). The
# newline is an expression: transformers renders with trim_blocks, which drops a newline
# written right after a block tag.
MARKED_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{{ '\\n' }}{% else %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> str:
    """About 60 KB of Python and prose from the standard library, the same on every run."""
    return "\n\n".join(Path(inspect.getsourcefile(m) or "").read_text()
                       for m in (json.decoder, textwrap, string))


@functools.lru_cache(maxsize=1)
def _trained() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([corpus()], trainer)
    return tok.to_str()  # a string: each caller gets its own Tokenizer


def make_tokenizer(chat_template: bool = True) -> Any:
    """A `PreTrainedTokenizerFast` with eos and pad tokens (and the chat template)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained()),
                                   eos_token=EOS, pad_token=PAD)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(folder: str | Path, chat_template: bool = True) -> Path:
    """Save the tokenizer into `folder` (created if needed) with `save_pretrained`."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(chat_template).save_pretrained(str(path))
    return path
