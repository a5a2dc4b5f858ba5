"""The ranks that run one model, and the model-level collectives over them.

[Note: model ranks] The engine's own checks run over a model's agreement groups ([Note:
model group] in mesh.py). So must the operations a user calls on the whole model: seeding
and replicated buffers in `materialize`, the agreements and the writer of checkpoints,
exports and pretrained loads, `full_state_dict(rank0_only=True)`,
`load_full_state_dict(from_rank0=True)`, the grad scaler's found-inf flag. On a model
sharded on a subgroup (ranks {1, 2} of 3, a pipeline stage, a 2 x 2 HYBRID_SHARD mesh on 4
of 5 ranks) the world's collectives waited for ranks that never run the model, or met
another model's collective there, and "rank 0" may not run the model at all.

`ModelGroup` is the model's ranks (ascending; the *first rank* is where a model-level
operation sends from or writes: global rank 0 when the model runs on every rank) and its
agreement groups. A model on every rank has groups [None]: each operation below is then
the one world collective it was before, at the same cost. On a subgroup that one of the
units' groups spans, it is that group's collective. On a product mesh no group spans the
model: the operation runs over each dim's group in turn (an agreement is a MAX, a broadcast
is relayed from the ranks that already hold the value, bytes gathered so far are gathered
again), which reaches every rank of the mesh. A model on one rank alone communicates not
at all.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..core.inspect import units_of
from ..core.mesh import agreement_groups, model_ranks


class ModelGroup:
    """One model's ranks and agreement groups ([Note: model ranks])."""

    def __init__(self, ranks: Iterable[int], groups: Iterable[ProcessGroup | None]) -> None:
        self.ranks = tuple(sorted(ranks))
        self.groups = list(groups)
        # Per group, the global rank a broadcast from the first rank comes from there
        # (None: no rank of that group holds it yet); made at the first multi-dim broadcast.
        self._sources: list[int | None] | None = None

    @classmethod
    def world(cls) -> ModelGroup:
        """Every rank (an unsharded model, or a call made before any model exists)."""
        return cls(range(C.world_size()), [None])

    @classmethod
    def of_units(cls, units: Iterable[Any]) -> ModelGroup:
        units = list(units)
        if not units or not C.is_initialized():
            return cls.world()
        ranks = model_ranks(units)
        groups = agreement_groups(units)
        return cls(ranks, groups if len(ranks) > 1 else [])

    @property
    def first(self) -> int:
        """The global rank model-level operations send from and write on."""
        return self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return C.rank() == self.first

    @property
    def index(self) -> int:
        """This rank's position among the model's ranks (0 on the first rank)."""
        return self.ranks.index(C.rank())

    def describe(self) -> str:
        """"rank 0" on every rank, "rank 1 (the first of ranks [1, 2])" on a subgroup."""
        if self.ranks == tuple(range(C.world_size())):
            return f"rank {self.first}"
        return f"rank {self.first} (the first of the model's ranks {list(self.ranks)})"

    # --- collectives over the model's ranks ----------------------------------------------

    def agree(self, flag: bool, label: str = "") -> bool:
        """True on every rank of the model iff `flag` is True on all of them."""
        if len(self.groups) == 1:
            return C.agree(flag, self.groups[0], label=label)
        return C.max_over([0 if flag else 1], self.groups, label=label)[0] == 0

    def max_(self, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        """The elementwise MAX of `tensor` over the model's ranks, in place (over each group
        in turn on a product mesh: a repeated rank changes nothing under MAX)."""
        for g in self.groups:
            C.all_reduce(tensor, g, op="max", label=label)
        return tensor

    def broadcast(self, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        """The first rank's `tensor`, in place on every rank of the model."""
        if len(self.groups) == 1:
            return C.broadcast(tensor, self.first, self.groups[0], label=label)
        for g, src in zip(self.groups, self._relay()):
            if src is not None:
                C.broadcast(tensor, src, g, label=label)
        return tensor

    def _relay(self) -> list[int | None]:
        """Each group's source for a broadcast from the first rank through the groups in
        turn: its lowest rank holding the value by then (one tiny all-reduce per group,
        once per ModelGroup: every broadcast of this model follows the same path)."""
        if self._sources is None:
            holds = C.rank() == self.first
            sources: list[int | None] = []
            for g in self.groups:
                n = C.world_size(g)
                lowest = -C.max_over([-C.rank(g) if holds else -n], [g],
                                     label="model broadcast path")[0]
                sources.append(C.global_rank_of(g, lowest) if lowest < n else None)
                holds = holds or lowest < n
            self._sources = sources
        return self._sources

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every model rank's `data`, in the order of `ranks`, on every rank of the model."""
        if not self.groups:
            return [data]
        if len(self.groups) == 1:
            g = self.groups[0]
            got = dict(zip(C.group_ranks(g), C.all_gather_bytes(data, g)))
            return [got[r] for r in self.ranks]
        have = {C.rank(): data}
        for g in self.groups:  # what each rank holds so far, gathered over the next dim
            for blob in C.all_gather_bytes(_pack(have), g):
                have.update(_unpack(blob))
        return [have[r] for r in self.ranks]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every model rank's `data` (order of `ranks`) on the first rank; [] elsewhere."""
        if len(self.groups) == 1:
            g = self.groups[0]
            dst = C.group_ranks(g).index(self.first)
            got = C.gather_bytes(data, dst=dst, group=g)
            if not got:
                return []
            by_rank = dict(zip(C.group_ranks(g), got))
            return [by_rank[r] for r in self.ranks]
        every = self.all_gather_bytes(data)
        return every if self.is_first else []


def model_group(model: object) -> ModelGroup:
    """The ModelGroup of a sharded `model`; the world for anything else (a plain module, a
    wrong argument that a check will refuse next: every rank reaches that check)."""
    if not isinstance(model, nn.Module):
        return ModelGroup.world()
    return ModelGroup.of_units(units_of(model))


def _pack(items: dict[int, bytes]) -> bytes:
    """{global rank: bytes} as (rank, length, bytes) records: never pickle."""
    return b"".join(struct.pack("<qq", r, len(b)) + b for r, b in sorted(items.items()))


def _unpack(blob: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    at = 0
    while at < len(blob):
        r, n = struct.unpack_from("<qq", blob, at)
        at += 16
        out[r] = blob[at: at + n]
        at += n
    return out
