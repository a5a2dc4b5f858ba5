"""Data for a Hugging Face model: its own tokenizer, the data formats, and each document as
token ids with a loss mask.

[Note: token data formats] `data.path` is a file or a folder (every file under it, sorted by
path, hidden files and folders skipped), or a folder written by `save_to_disk`. A file
ending in `.jsonl` is JSON Lines; `.json` (a JSON array of records, or JSON Lines),
`.parquet` and `.arrow` files hold records too (records.py); any other file is UTF-8 text and
is one document. A record file's first record decides its format, and every later record
must carry the same field:

- `{"text": ...}`: one document; every token counts for the loss.
- `{"prompt": ..., "completion": ...}`: as TRL's SFT with `completion_only_loss`: the EOS
  is added to the completion (unless it ends with it), `prompt + completion` is tokenized as
  one text, and the tokens from where it stops agreeing with the prompt tokenized alone
  count.
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation, rendered and
  tokenized by the tokenizer's chat template (no EOS added); the targets are exactly TRL's
  SFT with `assistant_only_loss=True`: the tokens the template renders inside its
  `{% generation %}` ... `{% endgeneration %}` blocks. A template without those markers
  cannot say which tokens are the assistant's: then each assistant turn counts from the end
  of the generation prompt to the end of the turn, less the whitespace the template writes
  after it (`Hi!<|im_end|>`, not the newline), and the run says so in one warning line. A
  tokenizer without a chat template gets a plain format: one `{role}: {content}` line per
  message, each assistant turn closed by the EOS token before its newline
  (`assistant: Hi!<eos>`, which counts up to the EOS); at sampling time the prompt ends
  with `assistant: `.

A text is `[BOS if the tokenizer adds one] + tokens + [EOS]`, every token but the BOS
counting. Documents are then packed back to back (token_cache.py, token_parts.py).
A mask rather than -100 labels is stored: one byte per token, turned into -100 targets per
batch (what `F.cross_entropy` and Hugging Face's `labels` ignore by default).

transformers is imported on first use only: `import shardwise` stays torch-only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# What AutoTokenizer reads from a model folder (besides config.json): these files, and only
# these, are the tokenizer's part of the cache key.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "chat_template.jinja", "chat_template.json")
JSONL_SUFFIX = ".jsonl"
# Record files read by records.py (`.json`: a JSON array or JSON Lines; the others through
# the `datasets` library).
RECORD_SUFFIXES = (".json", ".parquet", ".arrow")
# Text files are tokenized in pieces of about this many characters, cut after a newline
# (a newline is its own pre-token in byte-level BPE, so the ids are the same; a
# SentencePiece-style tokenizer may add one word-start marker per piece).
_PIECE_CHARS = 1 << 20
# Documents per call into the Rust tokenizer (it encodes a batch in parallel).
BATCH_DOCS = 512
# A chat template that marks the assistant's tokens (what TRL's assistant_only_loss reads).
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
log = logging.getLogger(__name__)


def marks_assistant(tok: Any) -> bool:
    """Whether the tokenizer's chat template has `{% generation %}` blocks."""
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default", "")
    return bool(t) and _GENERATION.search(t) is not None


def unmarked_note(folder: str) -> str:
    """The warning for chat records under a template without generation markers."""
    return (f"the chat template of {folder!r} has no {{% generation %}} markers, so it cannot "
            "mark the assistant's tokens: each assistant turn counts from the end of the "
            "generation prompt to the end of the turn, trailing whitespace excluded (TRL's "
            "assistant_only_loss needs the markers; add them to the template to match it)")


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer files of a model folder, sorted by name."""
    root = Path(folder).expanduser()
    return sorted(p for p in root.iterdir() if p.name in TOKENIZER_FILES and p.is_file()) \
        if root.is_dir() else []


def load_tokenizer(folder: str | Path) -> Any:
    """The folder's own tokenizer (`AutoTokenizer`, local files only). Raises a one-line
    ValueError naming the folder when it has none, cannot be loaded, or has no EOS token."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist or is not a folder")
    names = {p.name for p in tokenizer_files(root)}
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        raise ValueError(
            f"no tokenizer in {str(root)!r} (no tokenizer.json or tokenizer_config.json): save "
            "one there with tokenizer.save_pretrained(folder)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure is "this folder's tokenizer is broken"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the tokenizer in {str(root)!r} cannot be loaded: {first}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {str(root)!r} has no eos_token, which separates "
                         "documents: set one (tokenizer.eos_token = ...) and save it again")
    return tok


def data_files(path: str | Path, option: str = "data.path") -> list[Path]:
    """The files of `data.path`: the file itself, or every file under the folder, sorted by
    path (hidden files and folders skipped). `option`: the option named in errors."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not any(
            part.startswith(".") for part in q.relative_to(p).parts) and not _dataset_meta(q))
        if files:
            return files
        raise ValueError(f"{option}={str(path)!r} is a folder with no files")
    raise ValueError(f"{option}={str(path)!r} does not exist")


def _dataset_meta(f: Path) -> bool:
    """save_to_disk's metadata beside its .arrow files (not records)."""
    from .records import DATASET_META

    return f.name in DATASET_META and any(f.parent.glob("*.arrow"))


# A document before tokenization: ("text", str), ("pc", prompt, completion) or
# ("chat", messages).
Doc = tuple[Any, ...]


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what}")


def _field(obj: dict[str, Any], name: str, where: str, fmt: str) -> Any:
    if name not in obj:
        raise _bad(where, f"no {name!r} field (this file's first record is {fmt})")
    return obj[name]


def _string(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, f"the {name!r} field must be a string, not {type(value).__name__}")
    return value


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _bad(where, "the 'messages' field must be a non-empty list of "
                          "{role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise _bad(where, f"messages[{i}] must be an object with string 'role' and "
                              "'content' fields")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _format_of(obj: dict[str, Any], where: str) -> str:
    for fmt, keys in (("chat", ("messages",)), ("pc", ("prompt", "completion")),
                      ("text", ("text",))):
        if any(k in obj for k in keys):
            return fmt
    raise _bad(where, "no 'text', 'prompt'/'completion' or 'messages' field "
                      f"(found: {', '.join(sorted(obj)) or 'none'})")


_FMT_NAMES = {"chat": "chat 'messages'", "pc": "'prompt'/'completion'", "text": "'text'"}


def record_doc(obj: Any, where: str, fmt: str = "") -> tuple[Doc, str]:
    """One record (a JSONL line, a JSON array item, a dataset row) -> (its document, the
    format). `fmt` is the source's format so far ("": this record decides it)."""
    if not isinstance(obj, dict):
        raise _bad(where, f"a JSON object is needed, not {type(obj).__name__}")
    fmt = fmt or _format_of(obj, where)
    label = _FMT_NAMES[fmt]
    if fmt == "text":
        doc: Doc = ("text", _string(_field(obj, "text", where, label), "text", where))
    elif fmt == "pc":
        doc = ("pc", *(_string(_field(obj, k, where, label), k, where)
                       for k in ("prompt", "completion")))
    else:
        doc = ("chat", _messages(_field(obj, "messages", where, label), where))
    return doc, fmt


def jsonl_docs(path: Path, name: str) -> Iterator[tuple[Doc, str, int]]:
    """The records of a JSON Lines file (blank lines skipped), named by line."""
    fmt = ""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{name} line {lineno}"
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                msg = (f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError)
                       else "not UTF-8")
                raise _bad(where, f"not valid JSON ({msg})") from None
            doc, fmt = record_doc(obj, where, fmt)
            yield doc, where, len(raw)


def _text_doc(path: Path, name: str) -> Doc:
    try:
        return ("text", path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text (byte {e.start}); only .jsonl and UTF-8 "
                         "text files are data") from None


def read_documents(path: str | Path) -> Iterator[tuple[Doc, str, int]]:
    """Every document of `data.path` in order, with where it is ("data.jsonl line 7", for
    errors) and the bytes of input it came from (for progress). Raises a one-line ValueError
    at the first bad record, naming the file and line."""
    from . import records as R

    root = Path(path).expanduser()
    if R.saved_splits(root):
        raise ValueError(f"data path {str(path)!r} is a saved DatasetDict (splits "
                         f"{', '.join(R.saved_splits(root))}): give one split's folder")
    if R.is_saved_dataset(root):
        yield from R.saved_docs(root, root.name)
        return
    for f in data_files(root):
        name = f.name if f == root else f.relative_to(root).as_posix()
        if f.suffix == JSONL_SUFFIX:
            yield from jsonl_docs(f, name)
        elif f.suffix in RECORD_SUFFIXES:
            yield from R.file_docs(f, name)
        else:
            yield _text_doc(f, name), name, f.stat().st_size


def _pieces(text: str) -> list[str]:
    out, start = [], 0
    while len(text) - start > _PIECE_CHARS:
        cut = text.find("\n", start + _PIECE_CHARS) + 1
        if cut <= 0:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


@dataclass
class Encoded:
    """One document: token ids and, per token, whether it counts as a training target."""

    ids: np.ndarray  # (n,) int64
    mask: np.ndarray  # (n,) uint8, 1 = counts


class Encoder:
    """Turns documents into `Encoded` ([Note: token data formats])."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos = int(tok.eos_token_id)
        # The largest id + 1 (added tokens may sit past len(tok)): it decides the file dtype.
        self.vocab_size = max(len(tok), max(tok.get_vocab().values(), default=0) + 1)
        self.chat_template = bool(getattr(tok, "chat_template", None))
        self.marked = self.chat_template and marks_assistant(tok)
        self.warned = False  # the unmarked-template warning, once
        # What the tokenizer puts around a text by itself (a BOS for Llama, nothing for
        # GPT-2): the part before the text is kept, an EOS after it is ours to add.
        with_special = tok("a")["input_ids"]
        plain = tok("a", add_special_tokens=False)["input_ids"]
        at = next((i for i in range(len(with_special) - len(plain) + 1)
                   if with_special[i:i + len(plain)] == plain), 0)
        self.prefix = list(with_special[:at])

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tok(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def _doc(self, parts: Sequence[tuple[Sequence[int], int]]) -> Encoded:
        ids = [*self.prefix]
        mask = [0] * len(self.prefix)
        for toks, counts in parts:
            ids.extend(toks)
            mask.extend([counts] * len(toks))
        last = mask[-1] if len(mask) > len(self.prefix) else 0
        return Encoded(np.asarray([*ids, self.eos], dtype=np.int64),
                       np.asarray([*mask, last], dtype=np.uint8))

    def encode(self, docs: Sequence[Doc], wheres: Sequence[str]) -> list[Encoded]:
        """The documents, in order (one batched tokenizer call per kind); `wheres` name them
        in errors."""
        out: list[Encoded | None] = [None] * len(docs)
        texts = [(i, d[1]) for i, d in enumerate(docs) if d[0] == "text"]
        pieces = [_pieces(t) for _, t in texts]
        flat = iter(self._ids([p for ps in pieces for p in ps]))
        for (i, _), ps in zip(texts, pieces):
            out[i] = self._doc([(t, 1) for t in (next(flat) for _ in ps)])
        pcs = [(i, d) for i, d in enumerate(docs) if d[0] == "pc"]
        if pcs:
            # TRL's completion_only_loss: the prompt alone, and prompt + completion + EOS as
            # one text (each with the tokenizer's own special tokens).
            eos = self.tok.eos_token
            p_ids = self.tok([d[1] for _, d in pcs])["input_ids"]
            f_ids = self.tok([d[1] + d[2] + ("" if d[2].endswith(eos) else eos)
                              for _, d in pcs])["input_ids"]
            for (i, _), p, f in zip(pcs, p_ids, f_ids):
                k = next((j for j, (a, b) in enumerate(zip(p, f)) if a != b), min(len(p),
                                                                                len(f)))
                out[i] = Encoded(np.asarray(f, dtype=np.int64),
                                 np.asarray([0] * k + [1] * (len(f) - k), dtype=np.uint8))
        chat_ids = [i for i, d in enumerate(docs) if d[0] == "chat"]
        if chat_ids and self.marked:
            got = self._apply([docs[i][1] for i in chat_ids], wheres, chat_ids)
            for i, ids, mask in zip(chat_ids, got["input_ids"], got["assistant_masks"]):
                out[i] = Encoded(np.asarray(ids, dtype=np.int64),
                                 np.asarray(mask, dtype=np.uint8))
            chat_ids = []
        chats = [(i, self._render(docs[i][1], wheres[i])) for i in chat_ids]
        if chats and not self.warned:
            self.warned = True
            log.warning("%s", unmarked_note(getattr(self.tok, "name_or_path", "")))
        if chats:
            enc = self.tok([t for _, (t, _) in chats], add_special_tokens=False,
                           return_offsets_mapping=True)
            for (i, (_, spans)), ids, offsets in zip(chats, enc["input_ids"],
                                                      enc["offset_mapping"]):
                out[i] = self._chat_doc(ids, offsets, spans)
        return [e for e in out if e is not None]

    def _chat_doc(self, ids: list[int], offsets: list[tuple[int, int]],
                  spans: list[tuple[int, int]]) -> Encoded:
        # A token counts when it starts inside an assistant turn's characters.
        starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
        counts = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            counts |= ((starts >= a) & (starts < b)).astype(np.uint8)
        prefix = [] if self.chat_template else self.prefix
        return Encoded(np.asarray([*prefix, *ids], dtype=np.int64),
                       np.concatenate([np.zeros(len(prefix), np.uint8), counts]))

    def _apply(self, conversations: list[list[dict[str, str]]], wheres: Sequence[str],
               at: list[int]) -> Any:
        """TRL's tokenization of conversations: the template's ids and assistant masks."""
        try:
            return self.tok.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        except Exception:  # noqa: BLE001 - find the conversation the template refused
            for i, c in zip(at, conversations):
                self._text(c, False, wheres[i])
            raise

    def _render(self, messages: list[dict[str, str]],
                where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its assistant turns: each span
        runs from the end of the prefix rendered with a generation prompt to the end of the
        prefix that includes the turn."""
        full = self._text(messages, False, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._text(messages[:i], True, where)
            upto = self._text(messages[: i + 1], False, where)
            if not (upto.startswith(head) and full.startswith(upto)):
                raise ValueError(
                    f"{where}: the tokenizer's chat template does not render a conversation "
                    "prefix by "
                    "prefix (rendering messages[:k] is not the start of rendering all of "
                    "them), so its assistant turns cannot be located for the loss mask")
            # The turn's end, less the whitespace the template writes after it (a newline
            # after <|im_end|> belongs to the layout, not to the reply).
            spans.append((len(head), len(upto.rstrip())))
        return full, spans

    def _text(self, messages: list[dict[str, str]], generation_prompt: bool, where: str) -> str:
        if self.chat_template:
            try:
                return self.tok.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=generation_prompt)
            except Exception as e:  # noqa: BLE001 - a template raises what it likes
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(f"{where}: the chat template refused this conversation: "
                                 f"{first}") from e
        eos = self.tok.eos_token
        text = "".join(f"{m['role']}: {m['content']}{eos if m['role'] == 'assistant' else ''}\n"
                       for m in messages)
        return text + ("assistant: " if generation_prompt else "")
