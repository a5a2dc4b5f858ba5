"""The samples of a Hugging Face run: a seeded held-out split of documents, packed sequences
whose documents do not see each other, or one padded document per row, and the mixture of
several sources.

[Note: held-out split] Every document of a cache entry is cut into pieces of at most
seq_len + 1 tokens (a short record is one piece; a long text file is many). The pieces are
shuffled with data.seed, and the first ones of that order are held out until they hold
data.val_fraction of the tokens. So the validation set is drawn from every file and every
part of a file, not from the end of the last one, and it is a pure function of (the
entry, seq_len, seed, val_fraction): the same on every rank and on resume.

[Note: packing] Packed (data.packing, the default): a part is the virtual concatenation of
its pieces, consecutive pieces of one document joined again into one *segment*. Sequences
are windows of seq_len + 1 tokens of it (input and shifted target, windows sharing their
boundary token). Position ids restart at 0 where a segment starts inside a window, which
Hugging Face models turn into a block-diagonal causal mask ([Note: packed attention] in
hf_model.py), so a document never attends to the one before it; the target that is a segment's first
token does not count (nothing of its own document precedes it). A packed row's loss per
document then equals that document's loss run alone (tests/unit/test_token_parts.py).
Unpacked: each piece is one row, padded at the end to the longest row of the batch; padding
never counts and, being after the text, is never attended to by it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import data as D
from .token_cache import TokenData

IGNORE = -100  # the target of a position that does not count (F.cross_entropy's default)
Rows = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


@dataclass
class Pieces:
    """Pieces of documents in the cache's token coordinates, in file order; they tile the
    whole entry."""

    start: np.ndarray  # (S,) int64: first token
    length: np.ndarray  # (S,) int64
    doc: np.ndarray  # (S,) int64: the document it belongs to


def pieces(data: TokenData, size: int) -> Pieces:
    """Each document cut into consecutive pieces of `size` tokens (the last one shorter)."""
    starts = np.asarray(data.docs, dtype=np.int64)
    ends = np.append(starts[1:], len(data.tokens))
    k = -(-(ends - starts) // size)  # pieces per document
    doc = np.repeat(np.arange(len(starts)), k)
    nth = np.arange(len(doc)) - np.repeat(np.cumsum(k) - k, k)
    start = starts[doc] + nth * size
    return Pieces(start, np.minimum(size, ends[doc] - start), doc)


def held_out(p: Pieces, val_fraction: float, seed: int) -> np.ndarray:
    """(S,) bool: the pieces of the validation split ([Note: held-out split])."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(p.start))
    reach = np.cumsum(p.length[order])
    want = val_fraction * float(reach[-1]) if len(reach) else 0.0
    k = min(int(np.searchsorted(reach, want, side="left")) + 1, len(order) - 1)
    val = np.zeros(len(order), dtype=bool)
    val[order[:k]] = True
    return val


def split(data: TokenData, val_fraction: float, seq_len: int, seed: int,
          packed: bool = True) -> tuple[TokenPart, TokenPart]:
    """(training, validation) samples of one entry ([Note: held-out split]); the validation
    side keeps its packed tail ([Note: evaluation set] in eval_metrics.py)."""
    p = pieces(data, seq_len + 1)
    held = held_out(p, val_fraction, seed)
    return (TokenPart(data, p, ~held, seq_len, packed),
            TokenPart(data, p, held, seq_len, packed, tail=True))


class TokenPart:
    """The samples of one source on one side of the split ([Note: packing]).
    `rows(samples)` gives (inputs, targets, positions): (B, T) int64 tensors, targets -100
    where a token does not count, positions None when unpacked.

    tail: packed, also the last, shorter window (padded: input the pad token, target -100),
    so that every counted token is a target of exactly one sample. An evaluation set takes
    it; training does not (its windows stay full)."""

    def __init__(self, data: TokenData, p: Pieces, chosen: np.ndarray, seq_len: int,
                 packed: bool, tail: bool = False) -> None:
        self.tokens, self.mask, self.seq_len, self.packed = data.tokens, data.mask, seq_len, \
            packed
        self.pad = int(data.meta.get("eos_id", 0))
        self.n_tokens = int(p.length[chosen].sum())
        mask = np.asarray(data.mask, dtype=np.uint8)
        if packed:
            inside = np.repeat(chosen, p.length)  # 1 byte per token: in this part?
            s, n, d = p.start[chosen], p.length[chosen], p.doc[chosen]
            # A piece continues the previous one when both are of one document, adjacent.
            cont = np.zeros(len(s), dtype=bool)
            cont[1:] = (d[1:] == d[:-1]) & (s[1:] == s[:-1] + n[:-1])
            first = np.flatnonzero(~cont)
            self.seg_start = s[first]  # (G,) real start of each segment
            self.seg_v = np.cumsum(np.append(0, n))[first]  # (G,) its virtual start
            counted = mask[inside]  # (n_tokens,) virtual mask
            del inside
            counted[self.seg_v] = 0  # a segment's first token is not a target
            T = seq_len
            k = max((self.n_tokens - 1) // T, 0)
            has = counted[1 : k * T + 1].reshape(k, T).any(axis=1)
            self.samples = np.flatnonzero(has).astype(np.int64) * T  # window starts
            if tail and counted[k * T + 1 :].any():
                self.samples = np.append(self.samples, k * T)
        else:
            starts_all = p.start
            m = mask.copy()
            m[starts_all] = 0  # a piece's first token is an input only
            per = np.add.reduceat(m, starts_all) if len(m) else np.zeros(0, np.int64)
            keep = chosen & (p.length >= 2) & (per > 0)
            self.span_start, self.span_len = p.start[keep], p.length[keep]
            self.samples = np.arange(len(self.span_start), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def rows(self, idx: np.ndarray) -> Rows:
        return self._packed(idx) if self.packed else self._padded(idx)

    def _packed(self, idx: np.ndarray) -> Rows:
        T = self.seq_len
        v = self.samples[idx][:, None] + np.arange(T + 1)  # (B, T+1) virtual positions
        past = v >= self.n_tokens  # only in the tail window: padding
        v_in = np.minimum(v, self.n_tokens - 1)
        seg = np.searchsorted(self.seg_v, v_in, side="right") - 1
        real = self.seg_start[seg] + (v_in - self.seg_v[seg])
        toks = np.where(past, self.pad, np.asarray(self.tokens[real], dtype=np.int64))
        keep = (np.asarray(self.mask[real[:, 1:]]) != 0) & (v[:, 1:] != self.seg_v[seg[:, 1:]])
        y = np.where(keep & ~past[:, 1:], toks[:, 1:], IGNORE)
        # Positions restart at each segment start; a window's first token is position 0.
        pos = v[:, :-1] - np.maximum(self.seg_v[seg[:, :-1]], v[:, :1])
        return torch.from_numpy(toks[:, :-1].copy()), torch.from_numpy(y), \
            torch.from_numpy(pos)

    def _padded(self, idx: np.ndarray) -> Rows:
        s, n = self.span_start[self.samples[idx]], self.span_len[self.samples[idx]]
        width = int(n.max()) - 1
        x = np.full((len(idx), width), self.pad, dtype=np.int64)
        y = np.full((len(idx), width), IGNORE, dtype=np.int64)
        for i, (a, m) in enumerate(zip(s.tolist(), n.tolist())):
            row = np.asarray(self.tokens[a : a + m], dtype=np.int64)
            x[i, : m - 1] = row[:-1]
            y[i, : m - 1] = np.where(self.mask[a + 1 : a + m] != 0, row[1:], IGNORE)
        return torch.from_numpy(x), torch.from_numpy(y), None


class Mixture:
    """Several parts as one sample space (sample i of part k is `offsets[k] + i`), drawn by
    weight: an epoch is len(self) draws, each from part k with probability weights[k];
    within a part, samples come in a seeded order that starts again when used up."""

    def __init__(self, parts: Sequence[TokenPart], weights: Sequence[float]) -> None:
        self.parts = list(parts)
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.offsets = np.cumsum([0, *[len(p) for p in self.parts]])
        self.n_tokens = sum(p.n_tokens for p in self.parts)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sample order (global ids)."""
        n = len(self)
        if len(self.parts) == 1:
            return np.random.default_rng([seed, epoch]).permutation(n)
        src = np.random.default_rng([seed, epoch]).choice(len(self.parts), size=n,
                                                          p=self.weights)
        out = np.empty(n, dtype=np.int64)
        for k, part in enumerate(self.parts):
            at = np.flatnonzero(src == k)
            cycles = -(-len(at) // len(part))
            draws = [np.random.default_rng([seed, epoch, k, c]).permutation(len(part))
                     for c in range(cycles)]
            out[at] = self.offsets[k] + (np.concatenate(draws)[: len(at)] if draws else [])
        return out

    def rows(self, idx: np.ndarray) -> Rows:
        k = np.searchsorted(self.offsets, idx, side="right") - 1
        got: list[tuple[np.ndarray, Rows]] = []
        for part in np.unique(k).tolist():
            at = np.flatnonzero(k == part)
            got.append((at, self.parts[part].rows(idx[at] - self.offsets[part])))
        width = max(r[0].shape[1] for _, r in got)
        x = torch.full((len(idx), width), self.parts[0].pad, dtype=torch.long)
        y = torch.full((len(idx), width), IGNORE, dtype=torch.long)
        packed = got[0][1][2] is not None
        pos = torch.zeros((len(idx), width), dtype=torch.long) if packed else None
        for at, (xs, ys, ps) in got:
            t = torch.from_numpy(at)
            x[t, : xs.shape[1]], y[t, : ys.shape[1]] = xs, ys
            if pos is not None and ps is not None:
                pos[t, : ps.shape[1]] = ps
        return x, y, pos


def _on(rows: Rows, device: torch.device) -> tuple[torch.Tensor, ...]:
    x, y, pos = rows
    out = (x.to(device), y.to(device))
    return out if pos is None else (*out, pos.to(device))


class TokenBatchStream(D.BatchStream):
    """Training batches of one rank from a Mixture: `next()` gives (inputs, targets) or
    (inputs, targets, positions) when packed; the global order and its state are
    data.BatchStream's ([Note: data position])."""

    def __init__(self, mix: Mixture | TokenPart, seq_len: int, batch_size: int, rank: int,
                 world: int, seed: int, device: torch.device | str = "cpu") -> None:
        self.mix = mix if isinstance(mix, Mixture) else Mixture([mix], [1.0])
        super().__init__(torch.empty(0), seq_len, batch_size, rank, world, seed, device)

    def _windows(self, tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
        return torch.arange(len(self.mix))

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        return torch.from_numpy(self.mix.order(self.seed, epoch))

    def _batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _on(self.mix.rows(idx.numpy()), self.device)  # type: ignore[return-value]


def eval_rows(mix: Mixture | TokenPart, seed: int = 0) -> tuple[int, Callable[[np.ndarray], Rows]]:
    """The evaluation set as (number of samples, rows of sample ids): a fixed seeded order of
    the validation samples, so that a sampled evaluation (train.eval_batches > 0) draws from
    every source and file."""
    mix = mix if isinstance(mix, Mixture) else Mixture([mix], [1.0])
    order = np.random.default_rng([seed, 0xE7A1]).permutation(len(mix))
    return len(order), lambda idx: mix.rows(order[idx])
