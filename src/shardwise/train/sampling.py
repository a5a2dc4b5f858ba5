"""Text from a model: the trainer's end-of-run sample and `shardwise generate`.

One sampling loop for every model: `logits(idx)` gives (B, T, V); the last position's
temperature-scaled, top-k-filtered distribution is sampled, `block_size` tokens of context at
most. On a sharded model every rank must run it with the same input and an equally seeded
generator: each forward is collective, and identical inputs keep the ranks in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F


@torch.no_grad()
def sample_ids(logits: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor,
               max_new_tokens: int, block_size: int, *, temperature: float = 0.8,
               top_k: int | None = 40, generator: torch.Generator | None = None,
               eos: int | Collection[int] | None = None) -> torch.Tensor:
    """`idx` (1, T) followed by up to `max_new_tokens` sampled ids (stops after `eos`, an id
    or several: Hugging Face's generation configs list more than one, as Llama 3's do).
    temperature 0 is greedy: the most likely id, as Hugging Face's `generate` without
    sampling picks it (a tiny temperature would still draw among near-ties)."""
    stop = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    for _ in range(max_new_tokens):
        last = logits(idx[:, -block_size:])[:, -1, :].float()  # (1, V)
        if temperature == 0:
            nxt = last.argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
            if int(nxt) in stop:
                break
            continue
        out = last / temperature
        if top_k is not None:
            kth = torch.topk(out, min(top_k, out.shape[-1])).values[:, -1:]
            out = out.masked_fill(out < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(out, dim=-1), 1, generator=generator)  # (1, 1)
        idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        if int(nxt) in stop:
            break
    return idx


class ByteCodec:
    """The built-in GPT's tokens: UTF-8 bytes."""

    eos: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        # Escaped, not U+FFFD: a byte-level model can emit bytes that are not UTF-8.
        return bytes(ids).decode("utf-8", errors="backslashreplace")


class HFCodec:
    """A Hugging Face tokenizer from a local folder."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.tok: Any = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.eos: int | list[int] | None = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self.tok(text, add_special_tokens=True)["input_ids"]
        return ids or ([self.tok.bos_token_id] if self.tok.bos_token_id is not None else [0])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation rendered as training renders it (hf_data's chat format: the
        tokenizer's chat template, else `role: content` lines) up to the assistant's turn."""
        from .hf_data import Encoder

        enc = Encoder(self.tok)
        text = enc._text(messages, True, "the --chat prompt")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids if enc.chat_template else [*enc.prefix, *ids]


def sample_text(logits: Callable[[torch.Tensor], torch.Tensor], codec: ByteCodec | HFCodec,
                prompt: str, max_new_tokens: int, block_size: int, seed: int,
                device: torch.device, *, temperature: float = 0.8,
                top_k: int | None = 40) -> str:
    """The prompt and its continuation, as text."""
    idx = torch.tensor([codec.encode(prompt)], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = sample_ids(logits, idx, max_new_tokens, block_size, temperature=temperature,
                     top_k=top_k, generator=gen, eos=codec.eos)
    return codec.decode(out[0].tolist())
