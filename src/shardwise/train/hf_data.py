"""Data for a Hugging Face model: its own tokenizer, the data formats, and each document as
token ids with a loss mask.

[Note: token data formats] `data.path` is a file or a folder (every file under it, sorted by
path, hidden files and folders skipped), or a folder written by `save_to_disk`. A file
ending in `.jsonl` is JSON Lines; `.json` (a JSON array of records, or JSON Lines),
`.parquet` and `.arrow` files hold records too (records.py); any other file is UTF-8 text and
is one document. A record file's first record decides its format, and every later record
must carry the same field:

- `{"text": ...}`: one document; every token counts for the loss.
- `{"prompt": ..., "completion": ...}`: the two are tokenized separately and joined; only the
  completion's tokens (and the EOS that closes it) count.
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation, rendered by the
  tokenizer's chat template; only the assistant turns count (their content and whatever the
  template writes after it up to the next turn, e.g. `<|im_end|>`). A tokenizer without a
  chat template gets a plain format: one `{role}: {content}` line per message, each assistant
  turn closed by the EOS token before its newline (`assistant: Hi!<eos>`); at sampling time
  the prompt ends with `assistant: `.

Each document is `[BOS if the tokenizer adds one] + tokens + [EOS]`; the BOS never counts and
the closing EOS counts when the token before it does (a text or a completion: yes; a
conversation ending on a user turn: no). Documents are then packed back to back
(token_cache.py, token_parts.py).
A mask rather than -100 labels is stored: one byte per token, turned into -100 targets per
batch (what `F.cross_entropy` and Hugging Face's `labels` ignore by default).

transformers is imported on first use only: `import shardwise` stays torch-only.
"""

from __future__ import annotations

import json
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


def data_files(path: str | Path) -> list[Path]:
    """The files of `data.path`: the file itself, or every file under the folder, sorted by
    path (hidden files and folders skipped)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not any(
            part.startswith(".") for part in q.relative_to(p).parts) and not _dataset_meta(q))
        if files:
            return files
        raise ValueError(f"data.path={str(path)!r} is a folder with no files")
    raise ValueError(f"data.path={str(path)!r} does not exist")


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
        p_ids = self._ids([d[1] for _, d in pcs])
        c_ids = self._ids([d[2] for _, d in pcs])
        for (i, _), p, c in zip(pcs, p_ids, c_ids):
            out[i] = self._doc([(p, 0), (c, 1)])
        chats = [(i, self._render(d[1], wheres[i])) for i, d in enumerate(docs)
                 if d[0] == "chat"]
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
        last = int(counts[-1]) if len(ids) else 0
        return Encoded(np.asarray([*prefix, *ids, self.eos], dtype=np.int64),
                       np.concatenate([np.zeros(len(prefix), np.uint8), counts,
                                       np.asarray([last], np.uint8)]))

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
            spans.append((len(head), len(upto)))
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
